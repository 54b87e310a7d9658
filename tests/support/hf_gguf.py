"""transformers' reading of a GGUF file (``gguf_file=``), converted once per test session.

Reading SmolLM2's GGUF into transformers takes 17-28 s here (its tensors are de-quantized and its
tokenizer converted in Python), and several test files compare against it. The first caller saves
what transformers read (the model's config and float32 state dict, its generation config, the fast
tokenizer) into a directory that the session's xdist workers share; every caller loads from it in
about 3 s (``hf_model``, ``hf_tokenizer``). transformers refuses ``save_pretrained`` on a model read
from GGUF, hence the state dict. Saving and loading loses nothing: the reference is still
transformers' reading of the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

STATE = "state_dict.pt"


def _session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this session sees (each worker's base is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def hf_model(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedModel:
    """transformers' model read from ``gguf``, in float32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    d = hf_gguf_dir(gguf, tmp_path_factory)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    model.load_state_dict(torch.load(d / STATE, weights_only=True))
    model.generation_config = GenerationConfig.from_pretrained(d)
    return model.eval()


def hf_tokenizer(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """transformers' tokenizer read from ``gguf`` (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_gguf_dir(gguf, tmp_path_factory))


def hf_gguf_dir(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding transformers' reading of ``gguf`` (config, state dict, tokenizer).

    Converted by the first caller of the session, under an exclusive lock; later callers (in this
    or another worker) wait for the lock, then find the directory complete."""
    st = gguf.stat()
    out = _session_dir(tmp_path_factory) / f"hf-{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "done").exists():
            _convert(gguf, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    staging.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # what marks it "from GGUF": its tensors are float32 now
    (staging / "config.json").write_text(json.dumps(config))
    model.generation_config.save_pretrained(staging)
    torch.save(model.state_dict(), staging / STATE)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    (staging / "done").touch()
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
