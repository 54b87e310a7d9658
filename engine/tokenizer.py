"""ModelTokenizer: a checkpoint's tokenizer, its special tokens, chat template and EOS ids.

From a Hugging Face directory (``tokenizer.json``; ``tokenizer_config.json`` and/or
``chat_template.jinja`` for the special tokens and the chat template; ``generation_config.json``
for extra EOS ids) or a GGUF file (``pdserve.engine.model.gguf``). It behaves as transformers'
tokenizer of the same files:

- ``encode(text)`` adds special tokens the way the tokenizer says: the post-processor of
  ``tokenizer.json`` (BOS for Llama 3), or for a GGUF file its ``add_bos_token`` /
  ``add_eos_token`` flags. Special tokens written in the text are read as those tokens unless
  ``split_special_tokens``.
- ``encode_chat(messages)`` renders the chat template and encodes the result without adding
  special tokens (the template writes them), as ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pdserve.engine.chat_template import ChatTemplateError, render_chat

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the tokenizer's config says beyond ``tokenizer.json``."""

    chat_template: str | None = None
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)
    # A GGUF file's flags (its tokenizer has no post-processor); None: as the post-processor does.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    generation_eos_token_ids: tuple[int, ...] = ()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def read_tokenizer_dir(model_dir: str | Path) -> tuple[Tokenizer, TokenizerInfo]:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer.json not found in model directory {model_dir}")
    config = _read_json(model_dir / "tokenizer_config.json")
    generation = _read_json(model_dir / "generation_config.json")
    info = TokenizerInfo(
        chat_template=_chat_template(model_dir, config),
        special_tokens={name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES},
        generation_eos_token_ids=_ids(generation.get("eos_token_id")),
    )
    return Tokenizer.from_file(str(path)), info


class ModelTokenizer:
    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo) -> None:
        self.raw = tokenizer
        self.info = info
        self._split: Tokenizer | None = None  # reads special tokens in text as text; made on first use
        self.bos_token_id = self._id(info.special_tokens.get("bos_token"))
        self.eos_token_id = self._id(info.special_tokens.get("eos_token"))

    @classmethod
    def from_path(cls, path: str | Path) -> ModelTokenizer:
        """From a checkpoint directory or a ``.gguf`` file."""
        if str(path).endswith(".gguf"):
            from pdserve.engine.model.gguf_tokenizer import read_gguf_tokenizer

            return cls(*read_gguf_tokenizer(path))
        return cls(*read_tokenizer_dir(path))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.raw.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        tok = self.raw
        if split_special_tokens:
            if self._split is None:
                self._split = Tokenizer.from_str(self.raw.to_str())
                self._split.encode_special_tokens = True
            tok = self._split
        ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            ids = self._apply_bos_eos(ids)
        return ids

    def _apply_bos_eos(self, ids: list[int]) -> list[int]:
        """A GGUF file's ``add_bos_token`` / ``add_eos_token`` flags (its tokenizer has no
        post-processor): add what they ask for, never remove a token the text itself wrote."""
        bos, eos, info = self.bos_token_id, self.eos_token_id, self.info
        if bos is not None and info.add_bos_token and not (ids and ids[0] == bos):
            ids = [bos, *ids]
        if eos is not None and info.add_eos_token and not (ids and ids[-1] == eos):
            ids = [*ids, eos]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:  # fmt: skip
        """The chat template applied to ``messages``; ``ChatTemplateError`` when there is none."""
        if self.info.chat_template is None:
            raise ChatTemplateError("this model has no chat template: send a text prompt instead")
        return render_chat(self.info.chat_template, messages, self.info.special_tokens, add_generation_prompt,
                           **kwargs)  # fmt: skip

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:  # fmt: skip
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)
