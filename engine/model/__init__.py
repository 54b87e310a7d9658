"""Llama-family model: config parsing, safetensors loading, paged forward pass, tiny test models."""

from __future__ import annotations

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.loader import load_model, load_tokenizer
from pdserve.engine.model.tiny import make_tiny_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "load_tokenizer", "make_tiny_model"]
