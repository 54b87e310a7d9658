"""Models by name: a Hugging Face Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``) resolved to a
local checkpoint directory, as ``vllm serve MODEL`` does.

``resolve_model`` is the one place this happens; ``pdserve up`` (for the router and every
worker), ``pdserve demo`` and ``pdserve generate --model`` call it, and everything after it sees
a local directory (or ``.gguf`` file) only. The Hub's own settings apply: ``HF_HOME`` /
``HF_HUB_CACHE`` (where the cache is), ``HF_TOKEN``, ``HF_ENDPOINT``; ``HF_HUB_OFFLINE=1``
(``pdserve.envs.hf_hub_offline``) reads the cache only and never touches the network.
"""

from __future__ import annotations

import re
from pathlib import Path

from pdserve import envs

# owner/name, as the Hub spells ids (letters, digits, "-", "_", "."; no "--" or ".." anywhere).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# What the engine reads from a checkpoint (loader.py, tokenizer.py): nothing else is downloaded
# (no *.bin / *.pt duplicates of the weights, no images or ONNX exports).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.gguf", "*.txt", "*.model"]


def is_hub_id(model: str) -> bool:
    """True when ``model`` is spelled as a Hub id (``owner/name``) and names no local path."""
    return bool(_REPO_ID.match(model)) and ".." not in model and "--" not in model \
        and not Path(model).expanduser().exists()  # fmt: skip


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local checkpoint ``model`` names.

    A path that exists (a directory or a ``.gguf`` file), or anything not spelled as a Hub id,
    comes back unchanged (the loader reports what is missing there). A Hub id is looked up in
    the Hub cache (``download_dir``, else ``$HF_HOME/hub``) at ``revision`` (default ``main``),
    downloading what is missing unless ``HF_HUB_OFFLINE`` is set; the result is the snapshot's
    directory, or its ``.gguf`` file when that is all the snapshot holds.

    Raises ValueError with a one-line message when the id cannot be resolved (not cached while
    offline, no such repository or revision, no network).
    """
    if not is_hub_id(model):
        return model
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = envs.hf_hub_offline()
    where = f"cache {download_dir}" if download_dir else "the Hugging Face cache ($HF_HOME/hub)"
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=offline,
                                 allow_patterns=ALLOW_PATTERNS)  # fmt: skip
    except (OSError, ValueError, HfHubHTTPError, httpx.HTTPError) as e:
        detail = " ".join(str(e).split())  # the Hub's messages span lines: one line here
        if offline:
            raise ValueError(f"model {model!r}{at} is not in {where} and HF_HUB_OFFLINE is set "
                             f"(download it first, or give a local directory)") from None  # fmt: skip
        raise ValueError(f"cannot resolve model {model!r}{at} from the Hugging Face Hub or {where}: "
                         f"{type(e).__name__}: {detail[:300]}") from None  # fmt: skip
    return _checkpoint_in(Path(str(path)), model)


def _checkpoint_in(snapshot: Path, model: str) -> str:
    """The snapshot directory when it holds ``config.json``; else its single ``.gguf`` file."""
    if (snapshot / "config.json").is_file():
        return str(snapshot)
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0])
    if ggufs:
        names = ", ".join(p.name for p in ggufs[:8])
        raise ValueError(f"model {model!r} holds several GGUF files ({names}): give one as --model "
                         f"{snapshot}/FILE.gguf")  # fmt: skip
    raise ValueError(f"model {model!r}: its snapshot {snapshot} has no config.json and no .gguf file")
