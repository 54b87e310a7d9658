"""The running service's state file: what ``pdserve up`` leaves for other commands on this machine.

``<state dir>/up.json`` (``PDSERVE_STATE_DIR``, default ``~/.pdserve``; the directory mode 0700,
the file 0600, as it holds the embedded Redis's password): ``{"pid", "router", "http", "redis_url",
"namespace"}``; never the router's API key (``router.api_key``), in clear or otherwise: a client
brings its own. Written when ``up`` is ready, removed when it stops. ``pdserve stats`` and
``pdserve bench serve --router`` without ``--redis-url`` read the Redis URL from it
(``index_config``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve import envs
from pdserve.kvindex.config import IndexConfig


def state_file() -> Path:
    return Path(envs.state_dir()) / "up.json"


def write_state(state: dict[str, object]) -> Path:
    path = state_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)
    return path


def read_state() -> dict | None:
    """The state of the ``up`` running on this machine, or None when there is none: no file, an
    unreadable one, or one whose ``up`` is gone (killed before it could remove it)."""
    try:
        state = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not _alive(state.get("pid")):
        return None
    return state


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, if not ours
        return True
    return True


def remove_state(pid: int) -> None:
    """Remove the state file if it is this process's (another ``up`` may have replaced it)."""
    state = read_state()
    if state is not None and state.get("pid") == pid:
        state_file().unlink(missing_ok=True)


def index_config(redis_url: str | None, namespace: str | None, state: dict | None = None) -> IndexConfig | None:
    """The Redis index a client command reads: ``redis_url`` / ``namespace`` (flags), else the
    environment (``PDSERVE_REDIS_URL``, ``PDSERVE_REDIS_NAMESPACE``), else ``state`` (default: the
    state file of the ``pdserve up`` on this machine) with its namespace unless one was given.
    None when none of them names a Redis."""
    cfg = IndexConfig(**{k: v for k, v in (("url", redis_url), ("namespace", namespace)) if v is not None})
    if cfg.url is not None:
        return cfg
    state = read_state() if state is None else state
    if not state or not state.get("redis_url"):
        return None
    return IndexConfig(state["redis_url"], namespace=namespace or state.get("namespace") or cfg.namespace)
