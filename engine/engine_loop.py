"""EngineLoop: steps an LLMEngine in a background thread and delivers each request's outputs.

Workers serve many concurrent requests from async code; the loop keeps the engine busy
while any request is live and hands every ``RequestOutput`` to the callback registered
with that request, on the loop thread. Callbacks must be quick and must not block
(``loop.call_soon_threadsafe`` into an asyncio queue is the intended use).

The loop is the engine's only driver while it runs (``LLM.generate`` on the same engine is
refused): two drivers would each step away the other's outputs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.kv_handover import KVLoad, RemotePrefill
from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput | BaseException], None]


class CpuShare(Protocol):
    """What the loop tells a worker's ``CoreShare`` (worker/core_share.py)."""

    def before_step(self) -> int: ...

    def idle(self) -> None: ...


class EngineLoop:
    MAX_UNATTRIBUTED_FAILURES = 3  # consecutive failed steps before every request is failed

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05,
                 on_idle: Callable[[], object] | None = None, on_idle_after_s: float = 1.0,
                 cpu_share: CpuShare | None = None) -> None:  # fmt: skip
        """``on_idle`` runs on the loop thread once per idle period, when the engine has had no
        work for ``on_idle_after_s`` (a worker gives memory back then, not between the steps of
        a busy stretch); it must be quick. ``cpu_share`` (a worker's ``CoreShare``) is told on the
        loop thread before each step and before each wait, and sets the step's torch threads."""
        if engine.driver is not None:
            raise RuntimeError("the engine is already stepped by another driver")
        engine.driver = self
        engine.handover.on_blocks_freed = self.wake  # a released hand-off may let a request in
        self.engine = engine
        self._callbacks: dict[str, OutputCallback] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._idle_wait_s = idle_wait_s
        self._on_idle = on_idle
        self._on_idle_after_s = on_idle_after_s
        self._cpu_share = cpu_share
        self._busy = False  # inside a step or the delivery of its outputs
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_output: OutputCallback) -> None:
        """Queue ``request`` (built by ``engine.make_request``).

        Raises ValueError if its id belongs to a live request of this engine (a request
        id names one request at a time: outputs and blocks are looked up by it).
        """
        with self.engine.lock:
            self._check_free(request.request_id)
            self.engine.enqueue(request)
            self._callbacks[request.request_id] = on_output
        self._wake.set()

    def submit_remote(self, request: Request, on_output: OutputCallback, remote: RemotePrefill,
                      fill: Callable[[KVLoad], bool] | None = None) -> tuple[KVLoad | None, bool]:  # fmt: skip
        """``engine.add_remote`` with its outputs delivered to ``on_output``. Returns ``(load, filled)``:

        * ``(load, False)``: the ``KVLoad`` to write, already claimed (``engine.begin_load``); the
          caller ends it with exactly one ``finish_load``. Registering and claiming in one hold of
          the lock waits for one step boundary, not two.
        * ``(load, True)``: ``fill`` (called under the lock with the claimed load) wrote every block
          of it; the load is finished and the request runs from the next step. Nothing to end.
        * ``(None, False)``: no room in the pool; the request recomputes here instead.
        """
        filled = False
        with self.engine.lock:
            self._check_free(request.request_id)
            load = self.engine.add_remote(request, remote)
            self._callbacks[request.request_id] = on_output
            if load is not None:
                claimed = self.engine.begin_load(request.request_id)
                assert claimed, "a load just added is not aborted"
                if fill is not None:
                    try:
                        filled = fill(load)
                    except Exception:  # noqa: BLE001 - the load is still claimed: the caller writes it
                        logger.exception("filling the KV load of %s failed; it is written instead", request.request_id)
                    if filled:
                        self.engine.finish_load(request.request_id, True)
        if load is None or filled:
            self._wake.set()
        return load, filled

    def load_aborted(self, request_id: str) -> bool:
        """``engine.load_aborted``: the request of a claimed load was aborted (nothing to write)."""
        return self.engine.load_aborted(request_id)

    def finish_load(self, request_id: str, ok: bool) -> None:
        """``engine.finish_load``, then step: the request can run now."""
        self.engine.finish_load(request_id, ok)
        self._wake.set()

    def _check_free(self, request_id: str) -> None:
        if request_id in self._callbacks:
            raise ValueError(f"request_id: {request_id!r} is already in use")

    @property
    def num_registered(self) -> int:
        """Requests whose outputs this loop still delivers (submitted, not finished or aborted)."""
        with self.engine.lock:
            return len(self._callbacks)

    def abort(self, request_id: str) -> bool:
        with self.engine.lock:
            self._callbacks.pop(request_id, None)
            return self.engine.abort(request_id)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.handover.on_blocks_freed = None
        self.engine.driver = None

    def _deliver(self, cb: OutputCallback, out: RequestOutput | BaseException) -> None:
        try:
            cb(out)
        except Exception:  # a consumer's bug (or closed event loop) must not stop the engine
            logger.exception("output callback failed")

    def _fail_all(self, exc: BaseException) -> None:
        """The engine keeps failing outside any one batch: end every request with the error."""
        with self.engine.lock:
            rids = list(self._callbacks)
            callbacks = [self._callbacks.pop(rid) for rid in rids]
            for rid in rids:
                self.engine.abort(rid)
        for cb in callbacks:
            self._deliver(cb, exc)

    def _run(self) -> None:
        failures = 0
        idle_since: float | None = None  # None: busy, or the idle hook already ran for this idle period
        while not self._stopped:
            if not self.engine.has_unfinished():
                self._busy = False  # the last step's outputs are all delivered by now
                self._share_idle()
                if idle_since is not None and time.monotonic() - idle_since >= self._on_idle_after_s:
                    idle_since = None
                    self._idle_hook()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            idle_since = time.monotonic()  # from now on until the next step
            self._busy = True
            try:
                if self._cpu_share is not None:
                    self._cpu_share.before_step()
                # Outputs are matched with callbacks under the lock that produced them, so an
                # abort (and a reuse of the id) right after the step cannot misroute them.
                with self.engine.lock:
                    outputs = self.engine.step()
                    targets = [(self._callbacks.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._callbacks.pop(o.request_id, None)
            except Exception as exc:  # a failed forward already aborted its batch
                logger.exception("engine step failed")
                with self.engine.lock:
                    failed = [rid for rid in self._callbacks if rid not in self.engine.requests]
                    callbacks = [self._callbacks.pop(rid) for rid in failed]
                for cb in callbacks:
                    self._deliver(cb, exc)
                if callbacks:
                    failures = 0
                    continue
                # Nothing to blame (the failure was outside a batch): back off, and after a few
                # in a row fail every request rather than leave clients waiting forever.
                failures += 1
                if failures >= self.MAX_UNATTRIBUTED_FAILURES:
                    self._fail_all(exc)
                    failures = 0
                self._share_idle()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            failures = 0
            # Threads waiting for the engine's lock (a pull pinning blocks, a prefetch's holder waiting
            # for the next chunk's blocks) get it now: a lock is not fair, and this thread would
            # otherwise take it back for the next step before they run.
            time.sleep(0)
            if not outputs:
                # Work is queued but nothing fits now (blocks held by leases or pulls): wait for
                # a wake-up or a short timeout instead of spinning on the lock.
                self._share_idle()
                self._wake.wait(self._idle_wait_s / 5)
                self._wake.clear()
                continue
            for cb, out in targets:
                if cb is not None:
                    self._deliver(cb, out if out.error is None else out.error)

    def _share_idle(self) -> None:
        if self._cpu_share is None:
            return
        try:
            self._cpu_share.idle()
        except Exception:  # noqa: BLE001 - lending cores is an optimisation: it must not end the loop
            logger.exception("lending the engine's cores failed")

    def _idle_hook(self) -> None:
        if self._on_idle is None:
            return
        try:
            self._on_idle()
        except Exception:  # noqa: BLE001 - housekeeping must not stop the engine
            logger.exception("idle hook failed")

    def quiescent(self) -> bool:
        """True when the engine has no work left and every output it produced has been handed to
        its callback (for tests and shutdown: nothing more will be delivered until new work)."""
        return not self._busy and not self.engine.has_unfinished()

    def wake(self) -> None:
        """Blocks were freed outside the engine (a lease ended): try to schedule now."""
        self._wake.set()
