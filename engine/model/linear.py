"""Linear layers with a packed copy of their weight for CPU serving (oneDNN's, or panels for a C kernel).

float32: on x86 CPUs torch's ``F.linear`` goes through a BLAS whose kernels for skinny inputs (a
decode batch of 8-64 rows) have reached about half of what oneDNN (torch's ``mkldnn_linear``)
does on the same cores on some machines. Single-row inputs are the exception: oneDNN's per-call
conversions cost more than they save there. So a packed float32 layer keeps both copies of its
weight and picks per call by the number of input rows (``ONEDNN_MIN_ROWS``).

bfloat16: torch's ``F.linear`` already reaches oneDNN's AMX / AVX512-BF16 kernels, but hands
them the weight in its plain layout, which the kernel re-blocks on every call. The packed copy is
the weight reordered once into the blocked layout those kernels read
(``torch.ops.mkldnn._reorder_linear_weight``, as torch's Inductor packs bf16 linears) and run
through ``torch.ops.mkldnn._linear_pointwise``, which takes and returns dense tensors: no per-call
conversion, so every row count uses it. Results are bfloat16 like ``F.linear``'s (float32
accumulation inside the kernel); ``pdserve bench gemm`` measures both.

oneDNN compiles and caches a kernel per input shape (torch's ideep cache and oneDNN's primitive
cache, up to 1,024 entries each, a few hundred KiB apiece), and a serving worker sees a new row
count with nearly every prefill: its memory would grow by hundreds of MiB. So inputs past
``ONEDNN_MIN_BUCKET`` rows are padded up to a bucket (``bucket_rows``: at most 1/8 more rows,
about eight buckets per doubling), which bounds the shapes, and the caches, whatever the traffic.

``EngineConfig(cpu_onednn=False)`` turns it off; ``pdserve bench engine`` measures both.

float32 where the C kernels are built: the packed copy is not oneDNN's but
:class:`engine.kernels.cpu_gemm.PanelWeights`, the weight reordered once into panels that a C kernel
streams front to back, for every row count: a decode step of a few rows reads each weight at about the
memory's speed, and a prefill's products run faster than oneDNN's on the same cores
(``pdserve bench projections``). The two copies take the same memory. Likewise bfloat16 on a CPU with
AMX-BF16, for a layer whose inputs are a multiple of 32: :class:`engine.kernels.cpu_amx.AMXWeights`,
panels of AMX tiles that a C kernel streams, in place of oneDNN's copy. Without a packed copy, float32
inputs of 2 to 7 rows compute the transposed product, ``weight @ x.T`` (``SKINNY_ROWS``: the BLAS's
kernels for a skinny right-hand side read the weight at 2-4x the speed of those for a skinny
left-hand side), and transpose the small result back. A float32 layer's ``paths`` (``gemm_paths``,
timed when the model is packed) may send some row counts to that torch path despite its copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import cpu_amx, cpu_gemm
from pdserve.engine.kernels.kernel_weights import KernelWeights
from pdserve.engine.model.gemm_paths import RowPaths

# float32 inputs with fewer rows stay on F.linear (oneDNN's conversions dominate below ~8 rows).
ONEDNN_MIN_ROWS = 8
# bfloat16 inputs of any row count use the packed weight (no conversion to amortise).
ONEDNN_MIN_ROWS_BF16 = 1
# Row counts up to this run as they are (decode batches: few distinct shapes); larger ones in buckets.
ONEDNN_MIN_BUCKET = 64
# float32 CPU inputs with this many rows run as ``weight @ x.T`` without a packed copy (a single row
# is as fast either way).
SKINNY_ROWS = range(2, ONEDNN_MIN_ROWS)


def bucket_rows(rows: int) -> int:
    """The row count an input of ``rows`` rows runs at: itself up to ``ONEDNN_MIN_BUCKET``, else
    rounded up to a multiple of 1/8 of its power of two (at most 12.5% more rows)."""
    if rows <= ONEDNN_MIN_BUCKET:
        return rows
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


def onednn_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the oneDNN path can serve: CPU, torch built with oneDNN, float32, or bfloat16
    where oneDNN has bfloat16 kernels for this CPU (AVX512 and newer)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class OneDNNWeights:
    """A oneDNN copy of one linear map (weight ``[out, in]`` and optional bias), float32 or bfloat16.

    Not an ``nn.Module`` on purpose: the copy is derived state, never saved, moved or
    cast with the model; its owner rebuilds it from the dense weight when needed.
    ``min_rows``: the fewest input rows worth sending through it (``project``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bf16 = weight.dtype == torch.bfloat16
        self.min_rows = ONEDNN_MIN_ROWS_BF16 if self.bf16 else ONEDNN_MIN_ROWS
        if self.bf16:  # blocked once for the AMX / AVX512-BF16 kernels; the bias stays dense
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self.bias = None if bias is None else bias.detach()
        else:
            self.weight = weight.detach().to_mkldnn()
            self.bias = None if bias is None else bias.detach().to_mkldnn()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for a 2-D CPU ``x`` of the weight's dtype; a dense result. Rows run
        padded to ``bucket_rows`` (each output row depends on its input row alone: the padding is
        dropped)."""
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        if self.bf16:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        else:
            out = torch.ops.aten.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()
        return out if padded == rows else out[:rows]


PackedWeights = OneDNNWeights | cpu_gemm.PanelWeights | cpu_amx.AMXWeights


def packed_copy(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeights:
    """The packed copy :func:`project` runs a layer through: panels for the C kernel for a float32
    weight where it is built, AMX tiles for a bfloat16 one where the CPU and its shape allow
    (``cpu_amx.available``), else oneDNN's copy. Raises ValueError where none takes the weight."""
    if cpu_gemm.available(weight):
        return cpu_gemm.PanelWeights(weight, bias)
    if cpu_amx.available(weight):
        return cpu_amx.AMXWeights(weight, bias)
    if not onednn_supported(weight.dtype, weight.device):
        raise ValueError(f"a packed linear needs float32 or bfloat16 CPU weights (bfloat16: a CPU oneDNN has "
                         f"bfloat16 kernels for), got {weight.dtype} on {weight.device}")  # fmt: skip
    return OneDNNWeights(weight, bias)


def takes_copy(packed: PackedWeights | None, paths: RowPaths | None, rows: int) -> bool:
    """Whether a 2-D input of ``rows`` rows runs through ``packed`` (:func:`project`'s choice)."""
    return packed is not None and rows >= packed.min_rows and (paths is None or not paths.use_torch(rows))


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: PackedWeights | None, paths: RowPaths | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: through the packed copy for 2-D inputs of at least its ``min_rows``
    rows when one is given, unless ``paths`` (``gemm_paths``) sends inputs of that many rows to torch;
    as ``(weight @ x.T).T`` for float32 CPU inputs of ``SKINNY_ROWS`` rows; else ``F.linear``. The
    result is contiguous."""
    if x.dim() == 2:
        rows = x.shape[0]
        if takes_copy(packed, paths, rows):
            return packed(x)  # type: ignore[misc]
        if rows in SKINNY_ROWS and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
            out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
            return out.t().contiguous()
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that runs 2-D CPU inputs through a packed copy.

    After :meth:`pack`, 2-D inputs go through the copy :func:`packed_copy` makes: every row count
    through the panel kernel (float32, where it is built) or the AMX tile kernel (bfloat16, where the
    CPU has AMX-BF16 and the inputs are a multiple of 32), else those of at least
    ``ONEDNN_MIN_ROWS`` rows (float32) or of any row count (bfloat16) through oneDNN's. Without a
    copy, float32 CPU inputs of ``SKINNY_ROWS`` rows run as the transposed product; everything else
    is plain ``F.linear``. Results agree with ``F.linear`` to the dtype's rounding (the summation
    order may differ).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._packed: PackedWeights | None = None
        self.paths: RowPaths | None = None  # which row counts skip the copy (gemm_paths); None: none

    def pack(self) -> None:
        """Build the packed copy (:func:`packed_copy`) from the current weights.

        Must be called after the weights are final: later in-place changes to
        ``weight``/``bias`` are not seen by the copy (call ``pack`` again).
        """
        self._packed = packed_copy(self.weight, self.bias)
        self.paths = None

    def unpack(self) -> None:
        """Drop the packed copy (every input then goes through torch's products)."""
        self._packed = None
        self.paths = None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def packed_copy(self) -> PackedWeights | None:
        return self._packed

    def kernel_for(self, rows: int) -> KernelWeights | None:
        """The C kernel's copy that a 2-D input of ``rows`` rows runs through (:func:`project`), or None
        where it takes another path (no copy, oneDNN's, or ``paths`` sends it to torch)."""
        packed = self._packed
        return packed if isinstance(packed, KernelWeights) and takes_copy(packed, self.paths, rows) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self._packed, self.paths)

