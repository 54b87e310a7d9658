"""Llama-family model: config parsing, safetensors loading, paged forward pass, tiny test models.

The names below are imported on first use (PEP 562), so that a torch-free submodule
(``config``, ``checkpoint``) can be imported without torch: the router and ``pdserve up``'s
driver read model configs and tokenizers but run no model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.model.checkpoint import load_tokenizer
    from pdserve.engine.model.config import ModelConfig
    from pdserve.engine.model.llama import LlamaForCausalLM
    from pdserve.engine.model.loader import load_model
    from pdserve.engine.model.tiny import make_tiny_model

_HOMES = {
    "ModelConfig": "config",
    "load_tokenizer": "checkpoint",
    "LlamaForCausalLM": "llama",
    "load_model": "loader",
    "make_tiny_model": "tiny",
}

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "load_tokenizer", "make_tiny_model"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
