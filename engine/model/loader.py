"""Load a Llama-family model and its tokenizer from a local HF-style directory or a GGUF file.

Expected directory layout: ``config.json``, ``tokenizer.json`` and either ``model.safetensors``
or ``model.safetensors.index.json`` plus the shards it names (``tokenizer_config.json``,
``chat_template.jinja`` and ``generation_config.json`` are read when present). A ``.gguf`` file
carries all of it (``pdserve.engine.model.gguf``). Nothing is downloaded; only safetensors and
GGUF are read (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.parallel.shard import TPShard, check_tensor_parallel
from pdserve.engine.tokenizer import ModelTokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on accelerators: what ``load_model`` uses when given no dtype. The
    engine's auto dtype (``engine/model/dtype.py``) also picks bfloat16 on CPUs with bfloat16
    matrix units for reduced-precision checkpoints, and passes its choice here explicitly."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights, in a stable order.

    Raises FileNotFoundError naming the directory when there are none, or naming
    the shard when the index refers to a file that is absent.
    """
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} found in model directory {model_dir}"
        )
    with index.open("r", encoding="utf-8") as f:
        weight_map: dict[str, str] = json.load(f).get("weight_map", {})
    if not weight_map:
        raise ValueError(f"{index} has an empty weight_map")
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"shard {path.name} listed in {INDEX_FILE} not found in {model_dir}")
    return files


def _iter_tensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | object]]:
    """Every tensor of ``files`` by name; ``lazy``: as slices that read only the part indexed (a
    tensor-parallel rank reads its shard, never the whole weight)."""
    # One shard open at a time keeps peak host memory near one shard.
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def check_model(path: str | Path) -> None:
    """FileNotFoundError / ValueError naming what is missing or unsupported, before any weight is read."""
    ModelConfig.from_path(path)
    if not str(path).endswith(".gguf"):
        weight_files(path)
    load_tokenizer(path)


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
    model = model.to(dtype=dtype).to_empty(device=device)
    model.keep_float32()
    model.model.rotary_emb.rebuild()
    model.load_weights(weights)
    model.requires_grad_(False)
    return model.eval()


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module that runs ``config``'s architecture."""
    if config.mla is not None:
        from pdserve.engine.model.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    return LlamaForCausalLM


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> ModelTokenizer:
    """The checkpoint's tokenizer (FileNotFoundError naming ``tokenizer.json`` if a directory lacks it).

    ``chat_template`` (template text, ``EngineConfig.chat_template``) replaces the checkpoint's
    own, as vLLM's ``--chat-template`` does; None keeps the checkpoint's.
    """
    tokenizer = ModelTokenizer.from_path(path)
    if chat_template is not None:
        tokenizer.info = dataclasses.replace(tokenizer.info, chat_template=chat_template)
    return tokenizer


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template`` value as template text: the contents of the file ``value``
    names, or ``value`` itself when it is an inline template (it has ``{`` or a newline).

    ValueError (one line) for a file that cannot be read, a value that is neither, and a
    template with a Jinja syntax error.
    """
    if "{" in value or "\n" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"chat template: cannot read the file {value!r} ({why}); give a template file "
                             "or the template itself") from None  # fmt: skip
    import jinja2

    from pdserve.engine.chat_template import _compile  # the compiler render_chat uses (cached)

    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return text
