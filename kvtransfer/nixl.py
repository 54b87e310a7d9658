"""NIXL, the optional transport library (``pdserve[nixl]``): loading it, and ``NixlAgent``, the one
wrapper of its agent that both sides of the NIXL transport use.

The library ships as ``nixl-cu12`` (module ``nixl_cu12``) or under the ``nixl`` meta package; either
is found. Without it ``load_nixl`` raises ``NixlUnavailable`` with the reason, and pdserve pulls by
shared memory or gRPC.

Agents run without NIXL's progress thread: with it, the library's thread polls without pause and
holds a core. The initiator of a transfer (the holder) progresses its own worker while it waits for
the transfer; the target (the puller) calls ``poll_notifs`` while it waits for the holder's answer,
which also progresses the connection's wire-up.

Trust (docs/kv-wire.md, README threat model): an agent's metadata lets whoever loads it read and
write the memory it describes, and over UCX's TCP transport still after that memory is deregistered,
until the agent that registered it ends (``NixlAgent.end``). A puller therefore sends only partial
metadata naming one staging region it made for that holder, and ends the region with its agent; a
holder never sends metadata at all (it only writes).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class NixlUnavailable(Exception):
    """NIXL cannot carry this pull (not installed, refused, its write failed or its notification is
    missing): the pull goes over gRPC instead. ``permanent``: NIXL cannot run in this process at all."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def load_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` of the installed library; ``NixlUnavailable`` without one."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # the meta package
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise NixlUnavailable(
                f"NIXL is not installed (pip install 'pdserve[nixl]'): {exc}", permanent=True
            ) from None
        load_cuda12_runtime()
    logging.getLogger("nixl").setLevel(logging.WARNING)  # the library logs every agent at INFO
    return nixl_agent, nixl_agent_config


def load_cuda12_runtime() -> bool:
    """Load CUDA 12's runtime into the process (global symbols) if it can be found; whether it is loaded.

    ``nixl-cu12``'s UCX module for CUDA memory links ``libcudart.so.12``. Where only CUDA 13's runtime is
    installed (torch's cu13 builds), that module does not load, UCX takes GPU memory for host memory and
    NIXL refuses to register it. The ``nvidia-cuda-runtime-cu12`` wheel (in ``pdserve[nixl]``) ships the
    library outside the loader's path; loaded here first, it satisfies the module's link. It needs no GPU.
    """
    candidates = ["libcudart.so.12"]
    try:
        import nvidia.cuda_runtime  # namespace package of the nvidia-cuda-runtime-cu12 wheel

        candidates += [str(Path(base) / "lib" / "libcudart.so.12") for base in nvidia.cuda_runtime.__path__]
    except ImportError:
        pass
    for name in candidates:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return True
    return False


def nixl_installed() -> bool:
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


@contextmanager
def _as_unavailable(doing: str) -> Iterator[None]:
    """The library's own errors (its exception types, RuntimeError) as ``NixlUnavailable``."""
    try:
        yield
    except NixlUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - nixl raises its own types
        raise NixlUnavailable(f"NIXL failed {doing}: {type(exc).__name__}: {exc}") from None


def split_ranges(local: np.ndarray, remote: np.ndarray, nbytes: int,
                 most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Ranges of ``nbytes`` at each ``local[i]`` -> ``remote[i]`` as pieces of at most ``most`` bytes:
    ``(local, remote, lengths)``, each range's pieces in order, covering it exactly."""
    if nbytes <= most:
        return local, remote, np.full(len(local), nbytes, dtype=np.uint64)
    count = -(-nbytes // most)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(most)
    lengths = np.minimum(np.uint64(nbytes) - offsets, np.uint64(most))
    n = len(local)
    return ((local[:, None] + offsets).reshape(-1), (remote[:, None] + offsets).reshape(-1),
            np.tile(lengths, n))  # fmt: skip


def descriptors(addrs: np.ndarray, nbytes: int | np.ndarray, device: int = 0) -> np.ndarray:
    """NIXL's Nx3 descriptor array: address, length (one for all, or one each), device id (a GPU's
    index; 0 for host memory)."""
    out = np.zeros((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = device
    return out


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor's memory: ("VRAM", index) on a GPU, ("DRAM", 0)."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


class _Ended:
    """What an ended ``NixlAgent`` holds instead of the library's agent: every call is refused."""

    def __getattr__(self, name: str) -> Any:
        raise NixlUnavailable("this NIXL agent has ended")


class NixlAgent:
    """One NIXL agent (UCX backend) named ``name``. Thread-safe: calls are serialized by a lock,
    except ``write``'s wait, which holds only its own transfer.

    Raises ``NixlUnavailable`` when the library or its UCX backend cannot start.
    """

    def __init__(self, name: str) -> None:
        nixl_agent, nixl_agent_config = load_nixl()
        try:
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:  # noqa: BLE001 - the library raises its own types, or RuntimeError
            raise NixlUnavailable(f"cannot start a NIXL agent: {exc}", permanent=True) from None
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend here", permanent=True)
        self.name = name
        self._lock = threading.Lock()
        self._loaded: set[str] = set()  # remote agents

    # -- memory ---------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> Any:
        """Register a contiguous tensor's memory (host or device); the handle ``unregister`` takes.
        Raises ``NixlUnavailable`` when the library refuses."""
        with self._lock, _as_unavailable("registering memory"):
            return self._agent.register_memory(tensor)

    def unregister(self, handle: Any) -> None:
        with self._lock:
            self._agent.deregister_memory(handle)

    def partial_metadata(self, handle: Any) -> bytes:
        """Metadata that lets a peer reach this agent and the one registration ``handle``, no other."""
        with self._lock, _as_unavailable("making metadata"):
            return self._agent.get_partial_agent_metadata(handle, True)

    # -- peers ----------------------------------------------------------------------------
    def load(self, metadata: bytes) -> str:
        """Load a peer's (partial) metadata, adding to what was loaded for it; its agent name. Raises
        the library's error for malformed metadata, this agent's own, or a loaded name with other
        connection details."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._loaded.add(name)
            return name

    def forget(self, name: str) -> None:
        """Drop a peer's metadata (and the connection to it); nothing if it was not loaded."""
        with self._lock:
            if name not in self._loaded:
                return
            self._loaded.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - a peer already gone
                logger.debug("NIXL: forgetting %s: %s", name, exc)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    # -- transfers ------------------------------------------------------------------------
    def write(self, local: np.ndarray, remote: np.ndarray, nbytes: int | np.ndarray, peer: str, notif: bytes,
              timeout_s: float, local_memory: tuple[str, int] = ("DRAM", 0)) -> None:  # fmt: skip
        """Write ``nbytes`` (one length for all, or one each) from each local address (in ``local_memory``,
        as ``memory_of`` names it) to the remote address at the same position, in ``peer``'s host memory,
        then notify ``peer`` with ``notif``; returns once the transfer is done.
        Raises ``NixlUnavailable`` on any failure of the library (a peer gone, an address outside
        what ``peer``'s metadata registers) or after ``timeout_s``."""
        kind, device = local_memory
        try:
            with self._lock:
                sources = self._agent.get_xfer_descs(descriptors(local, nbytes, device), kind)
                targets = self._agent.get_xfer_descs(descriptors(remote, nbytes), "DRAM")
                handle = self._agent.initialize_xfer("WRITE", sources, targets, peer, notif)
                state = self._agent.transfer(handle)
            try:
                deadline = time.monotonic() + timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlUnavailable(f"the NIXL write to {peer} took over {timeout_s}s")
                    time.sleep(0.0001)
                    with self._lock:
                        state = self._agent.check_xfer_state(handle)
            finally:
                with self._lock:
                    self._agent.release_xfer_handle(handle)
        except NixlUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - nixl's own error types (remote disconnect, not found, ...)
            raise NixlUnavailable(f"the NIXL write to {peer} failed: {type(exc).__name__}: {exc}") from None
        if state != "DONE":
            raise NixlUnavailable(f"the NIXL write to {peer} ended in state {state}")

    def poll_notifs(self) -> list[bytes]:
        """Progress this agent's worker and take the notifications that arrived since the last call."""
        with self._lock, _as_unavailable("progressing"):
            new = self._agent.get_new_notifs()
        return [msg for msgs in new.values() for msg in msgs]

    def close(self) -> None:
        """Forget every peer. The agent itself ends when the object is collected (NIXL has no close)."""
        for name in self.peers():
            self.forget(name)

    def end(self) -> None:
        """Forget every peer and drop the library's agent now: its UCX worker closes, and a peer's copy of
        metadata it gave out reaches nothing any more (deregistering alone does not stop a peer over UCX's
        TCP transport). Every later call raises ``NixlUnavailable``."""
        self.close()
        with self._lock:
            self._agent = _Ended()
