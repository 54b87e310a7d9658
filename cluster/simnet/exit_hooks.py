"""Tearing down every live cluster of this process at interpreter exit and on SIGTERM."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.cluster.simnet.cluster import SimCluster

_LIVE: set[SimCluster] = set()
_LIVE_LOCK = threading.RLock()
_HANDLERS: dict[str, Any] = {}  # "atexit": True once registered; "sigterm": the handler we replaced


def _teardown_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for sim in live:
        sim.close()


def _on_sigterm(signum: int, frame: Any) -> None:
    """Tear down every live cluster, then do what SIGTERM did before (by default: die of it)."""
    previous = _HANDLERS.get("sigterm", signal.SIG_DFL)  # before teardown: the last close restores it
    _teardown_all()
    _HANDLERS.pop("sigterm", None)
    signal.signal(signal.SIGTERM, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        os.kill(os.getpid(), signal.SIGTERM)


def register(sim: SimCluster) -> None:
    """Close ``sim`` at interpreter exit and on SIGTERM (the handler is installed from the main thread
    only, and the one it replaces runs after the teardown)."""
    with _LIVE_LOCK:
        _LIVE.add(sim)
        if not _HANDLERS.get("atexit"):
            atexit.register(_teardown_all)
            _HANDLERS["atexit"] = True
        # Python runs signal handlers in the main thread only, and only the main thread may set them.
        if "sigterm" not in _HANDLERS and threading.current_thread() is threading.main_thread():
            _HANDLERS["sigterm"] = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)


def unregister(sim: SimCluster) -> None:
    """Forget ``sim``; the last one gone restores the SIGTERM handler ``register`` replaced."""
    with _LIVE_LOCK:
        _LIVE.discard(sim)
        main = threading.current_thread() is threading.main_thread()
        if not _LIVE and "sigterm" in _HANDLERS and main and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _HANDLERS.pop("sigterm"))
