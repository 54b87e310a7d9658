"""ModelTokenizer against transformers' tokenizer of the same files: text with special tokens,
chat templates (from tokenizer_config.json or chat_template.jinja, with a system message), the
template sandbox, and EOS ids from generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import LLM
from pdserve.engine.chat_template import ChatTemplateError
from pdserve.engine.model import make_tiny_model
from pdserve.engine.tokenizer import ModelTokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|sys|>{{ m['content'] | trim }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}{{ eos_token }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi, ünïcödé 😀"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny_model(tmp_path_factory.mktemp("tok") / "m")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True},
        "chat_template": TEMPLATE,
    }))  # fmt: skip
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 299]}))
    return d


def test_text_and_chat_match_transformers(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    ours, hf = ModelTokenizer.from_path(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    for text in ["hello", " spaces  and\nnewlines", "literal </s> special", "ünïcödé 😀"]:
        assert ours.encode(text) == hf(text).input_ids  # the post-processor's BOS
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    for chat in CHATS:
        assert ours.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True,
                                                                return_dict=True)["input_ids"]  # fmt: skip
        assert ours.render_chat(chat, add_generation_prompt=False) == hf.apply_chat_template(chat, tokenize=False)
    # split_special_tokens reads "</s>" as four characters.
    assert 257 in ours.encode("a</s>") and 257 not in ours.encode("a</s>", split_special_tokens=True)


def test_chat_template_jinja_file_wins_and_templates_are_sandboxed(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(checkpoint, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = ModelTokenizer.from_path(d)
    assert tok.render_chat(CHATS[0]) == "[user] What is the capital of France?\n"
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ModelTokenizer.from_path(checkpoint).render_chat([{"role": "tool", "content": "x"}])
    # A template is untrusted code: no way out of the sandbox.
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        ModelTokenizer.from_path(d).render_chat(CHATS[0])
    # A request's template variables may take any name the call's own parameters have.
    (d / "chat_template.jinja").write_text("{{ template }}/{{ special_tokens }}/{{ messages | length }}")
    named = ModelTokenizer.from_path(d).render_chat(CHATS[0], False, template="t", special_tokens="s")
    assert named == "t/s/1"
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ModelTokenizer.from_path(d).render_chat(CHATS[0])


def test_generation_config_adds_eos_ids(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), num_blocks=16)
    assert llm.engine.eos_token_ids == (257, 299)  # config.json's 257, then generation_config's 299
