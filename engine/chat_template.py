"""Chat templates: a checkpoint's Jinja template rendered as transformers renders it.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox, with the same environment transformers sets up (``trim_blocks``, ``lstrip_blocks``,
loop controls, a ``tojson`` that keeps non-ASCII characters, ``raise_exception``,
``strftime_now``, and a ``{% generation %}`` block that renders its body), and see the same
variables: ``messages``, ``add_generation_prompt``, ``tools``, ``documents`` and the tokenizer's
special tokens (``bos_token``, ``eos_token``, ...). A request may add variables of its own
(``chat_template_kwargs``, as in transformers and vLLM) but never replace these or the
environment's functions (``reserved_variable``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or could not be rendered."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here
    the body is rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What the environment itself defines (Jinja's default globals and ours): a request's variable
# of the same name would hide it.
_GLOBALS = frozenset({"range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now"})
# Variables render_chat sets from the conversation and the tokenizer.
# ("chat_template": a template is code, never a request's variable; vLLM's GHSA-x567-49g5-p4cf.)
# "self": jinja2's Template.render takes its variables as keywords beside its own ``self``.
_SET_BY_RENDER = frozenset({"messages", "add_generation_prompt", "tools", "chat_template", "self"})


def reserved_variable(name: str, special_tokens: Mapping[str, str | None] = {}) -> str | None:  # noqa: B006
    """Why a request may not set the template variable ``name`` (None: it may): it would replace
    the conversation, a special token, or a function the environment provides."""
    if name in _SET_BY_RENDER:
        return "not a template variable a request may set (the request's own fields set it, or it is refused)"
    if name in special_tokens or name.endswith(("_token", "_tokens")):
        return "special tokens come from the tokenizer"
    if name in _GLOBALS:
        return "names a function of the template environment"
    return None


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Mapping[str, str | None],
    /,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """The prompt text of ``messages`` (dicts with ``role`` and ``content``) under ``template``; ``kwargs``
    are the template's other variables. The parameters before them are positional only, so that no variable's
    name collides with theirs (``reserved_variable`` says which names a request may not set).

    Raises ``ChatTemplateError`` when the template cannot be compiled or refuses the conversation.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: a message needs a string 'role'")
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
            **{**{k: v for k, v in special_tokens.items() if v is not None}, **kwargs},
        )  # fmt: skip
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # the template met data it cannot handle
        raise ChatTemplateError(f"chat template cannot render these messages: {type(e).__name__}: {e}") from e


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
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return text
