"""Load a Llama-family model's weights from a local HF-style directory or a GGUF file.

Expected directory layout: ``config.json``, ``tokenizer.json`` and either ``model.safetensors``
or ``model.safetensors.index.json`` plus the shards it names (``tokenizer_config.json``,
``chat_template.jinja`` and ``generation_config.json`` are read when present). A ``.gguf`` file
carries all of it (``pdserve.engine.model.gguf``). Nothing is downloaded; only safetensors and
GGUF are read (no pickle). The tokenizer and the checks that need no torch are in
``pdserve.engine.model.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.model.checkpoint import weight_files
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.parallel.shard import TPShard, check_tensor_parallel


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on accelerators: what ``load_model`` uses when given no dtype. The
    engine's auto dtype (``engine/model/dtype.py``) also picks bfloat16 on CPUs with bfloat16
    matrix units for reduced-precision checkpoints, and passes its choice here explicitly."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _iter_tensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | object]]:
    """Every tensor of ``files`` by name; ``lazy``: as slices that read only the part indexed (a
    tensor-parallel rank reads its shard, never the whole weight)."""
    # One shard open at a time keeps peak host memory near one shard.
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    shard: TPShard | None = None,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir`` (a directory or a ``.gguf`` file) and load its weights (strictly).

    ``dtype`` defaults to float32 on CPU and bfloat16 otherwise; checkpoint tensors
    are cast to it. Returns the model in eval mode with gradients disabled.
    Raises FileNotFoundError for a missing directory, config.json or weights, and
    ValueError for an unsupported config or missing/unexpected/misshapen tensors.

    ``shard``: build and load only that tensor-parallel rank's slice (ValueError when the model
    does not split that many ways); a safetensors checkpoint is read shard by shard, never whole.
    """
    model_dir = Path(model_dir)
    gguf = model_dir.suffix == ".gguf"
    if not gguf and not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_path(model_dir)
    shard = shard or TPShard()
    check_tensor_parallel(config, shard.size)
    if gguf:
        from pdserve.engine.model.gguf import iter_gguf_tensors

        weights = iter_gguf_tensors(model_dir)
    else:
        weights = _iter_tensors(weight_files(model_dir), lazy=shard.size > 1)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    # Build on the meta device so no time is spent on random init that gets overwritten.
    with torch.device("meta"):
        model = model_class(config)(config, shard)
    materialise(model.to(dtype=dtype), device)
    model.keep_float32()
    model.model.rotary_emb.rebuild()
    model.load_weights(weights)
    model.requires_grad_(False)
    return model.eval()


def materialise(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of ``model`` (built on the meta device) uninitialised storage
    on ``device``, of its shape and dtype, in place.

    What ``Module.to_empty`` does, without its ``empty_like`` of meta tensors: that goes through
    torch's Python reference kernels, which import sympy (~0.5 s of every worker's start)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module that runs ``config``'s architecture."""
    if config.mla is not None:
        from pdserve.engine.model.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    return LlamaForCausalLM

