"""Linear layers with an optional oneDNN path for CPU serving.

On x86 CPUs torch's float32 ``F.linear`` goes through a BLAS whose kernels for
skinny inputs (a decode batch of 8-64 rows) reach roughly half of what oneDNN
(torch's ``mkldnn_linear``) does on the same cores; on some CPUs oneDNN is also ~1.3x
faster on 2k-row prefill GEMMs. Single-row inputs are the exception: oneDNN's
per-call conversions cost more than they save there. So a packed layer keeps both
copies of its weight and picks per call by the number of input rows.

oneDNN compiles and caches a kernel per input shape (torch's ideep cache and oneDNN's primitive
cache, up to 1,024 entries each, a few hundred KiB apiece), and a serving worker sees a new row
count with nearly every prefill: its memory would grow by hundreds of MiB. So inputs past
``ONEDNN_MIN_BUCKET`` rows are padded up to a bucket (``bucket_rows``: at most 1/8 more rows,
about eight buckets per doubling), which bounds the shapes, and the caches, whatever the traffic.

``EngineConfig(cpu_onednn=False)`` turns it off; ``pdserve bench engine`` measures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Inputs with fewer rows stay on F.linear (oneDNN's conversions dominate below ~8 rows).
ONEDNN_MIN_ROWS = 8
# Row counts up to this run as they are (decode batches: few distinct shapes); larger ones in buckets.
ONEDNN_MIN_BUCKET = 64


def bucket_rows(rows: int) -> int:
    """The row count an input of ``rows`` rows runs at: itself up to ``ONEDNN_MIN_BUCKET``, else
    rounded up to a multiple of 1/8 of its power of two (at most 12.5% more rows)."""
    if rows <= ONEDNN_MIN_BUCKET:
        return rows
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


def onednn_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the oneDNN path can serve: CPU, float32, torch built with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class OneDNNWeights:
    """A oneDNN copy of one linear map (weight ``[out, in]`` and optional bias).

    Not an ``nn.Module`` on purpose: the copy is derived state, never saved, moved or
    cast with the model; its owner rebuilds it from the dense weight when needed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().to_mkldnn()
        self.bias = None if bias is None else bias.detach().to_mkldnn()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for a 2-D float32 CPU ``x``; a dense result. Rows run padded to
        ``bucket_rows`` (each output row depends on its input row alone: the padding is dropped)."""
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.aten.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()
        return out if padded == rows else out[:rows]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            onednn: OneDNNWeights | None) -> torch.Tensor:
    """``x @ weight.T + bias``: through ``onednn`` for 2-D inputs of ``ONEDNN_MIN_ROWS``+ rows
    when a copy is given, else ``F.linear``."""
    if onednn is not None and x.dim() == 2 and x.shape[0] >= ONEDNN_MIN_ROWS:
        return onednn(x)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that may run large inputs through oneDNN.

    After :meth:`pack`, 2-D inputs of at least ``ONEDNN_MIN_ROWS`` rows use the oneDNN
    copy; everything else (and every unpacked layer) is plain ``F.linear``. Results
    agree with ``F.linear`` to float32 rounding (the summation order differs).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._onednn: OneDNNWeights | None = None

    def pack(self) -> None:
        """Build the oneDNN copy from the current weights.

        Must be called after the weights are final: later in-place changes to
        ``weight``/``bias`` are not seen by the copy (call ``pack`` again).
        """
        if not onednn_supported(self.weight.dtype, self.weight.device):
            raise ValueError(f"oneDNN linear needs float32 CPU weights, got {self.weight.dtype} on "
                             f"{self.weight.device}")
        self._onednn = OneDNNWeights(self.weight, self.bias)

    def unpack(self) -> None:
        """Drop the oneDNN copy (every input then goes through ``F.linear``)."""
        self._onednn = None

    @property
    def packed(self) -> bool:
        return self._onednn is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self._onednn)

