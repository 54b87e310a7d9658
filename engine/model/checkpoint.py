"""What a checkpoint holds, read without torch: its weight files, its tokenizer, and a check of
everything a worker needs before any weight is read.

Processes that serve no model (the router, ``pdserve up``'s driver) use this module and never
import torch; ``pdserve.engine.model.loader`` reads the weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.tokenizer import ModelTokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> ModelTokenizer:
    """The checkpoint's tokenizer (FileNotFoundError naming ``tokenizer.json`` if a directory lacks it).

    ``chat_template`` (template text, ``EngineConfig.chat_template``) replaces the checkpoint's
    own, as vLLM's ``--chat-template`` does; None keeps the checkpoint's.
    """
    tokenizer = ModelTokenizer.from_path(path)
    if chat_template is not None:
        tokenizer.info = dataclasses.replace(tokenizer.info, chat_template=chat_template)
    return tokenizer


def check_model(path: str | Path) -> None:
    """FileNotFoundError / ValueError naming what is missing or unsupported, before any weight is read."""
    ModelConfig.from_path(path)
    if not str(path).endswith(".gguf"):
        weight_files(path)
    load_tokenizer(path)
