"""DecodeCall: one request's hold on a decode worker, from registration to its end.

A request takes three things on this worker: its registration with the engine (blocks, a
callback), the prefill worker's lease on its KV, and a pull of that KV into reserved blocks.
Each has one owner here that ends it exactly once, on every path (finished, failed, cancelled
while queued or while pulling, consumer gone, worker stopping):

* the registration: it runs on a thread of its own (it waits for the engine's lock, which a step
  holds: the event loop meanwhile streams the other requests' tokens); ``DecodeCall`` (an async
  context manager) aborts it on exit, after it, on a thread that is never cancelled, so neither
  a cancellation during the registration nor a second one during the abort can drop it;
* the pull: the registration claims the engine's load for writing (one wait for the engine's
  lock, not two); ``pull`` hands the claim to its own thread, which ends it with
  ``finish_load`` in its ``finally`` (without writing when the request was aborted first); a
  claim no pull took is ended on exit, after the abort, so the blocks go back at once;
  a pull the service can no longer run (it is closing) leaves the claim to the exit;
* the lease: ``settle_lease`` releases it once (after the pull, or unpulled), on threads of its
  own (a hung prefill worker delays no abort), and the exit settles it if nothing did, also when
  cancelled again while its abort runs.

Before registering, ``stage`` may pull the KV into a buffer of the call's own
(``decode_worker/staging.py``); the registration then fills the load from it and no pull follows.
The buffer touches nothing in the engine, so it needs no owner beyond the call.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from types import TracebackType

from pdserve.decode_worker.holder_slots import HolderSlots
from pdserve.decode_worker.staging import StagedKV, pull_staged
from pdserve.engine.engine_loop import OutputCallback
from pdserve.engine.kv_handover import KVLoad, RemotePrefill
from pdserve.engine.request import Request
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.errors import LayoutMismatchError, PeerUnavailableError, TransferError
from pdserve.kvtransfer.pull import pull_kv
from pdserve.worker.messages import PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from pdserve.worker.threads import run_to_end, wait_to_end

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class CallThreads:
    """The service's executors a call hands work to; their queued work is never cancelled.

    ``pulls`` runs pulls, at most ``holders.per_holder`` of one prefill worker's at once (a hung
    one cannot take them all: ``decode_worker/holder_slots.py``), ``registers`` registrations and
    ``ender`` aborts (one thread each: each waits for the engine's lock, which a step holds; never
    on the event loop that streams the other requests' tokens), and ``releases`` lease releases,
    apart from the aborts: a release to a hung prefill worker waits for its deadline, and must not
    hold up the end of other requests. ``compiles`` (one thread) compiles requests' structured-output
    constraints, which take seconds for a large schema over a large vocabulary: never on the event
    loop, nor on the registering thread that every request waits for.
    """

    pulls: Executor
    holders: HolderSlots
    registers: Executor
    ender: Executor
    releases: Executor
    compiles: Executor


class DecodeCall:
    """``async with DecodeCall(...) as call:`` after the engine registered ``spec``'s request;
    ``threads`` are the service's (``CallThreads``)."""

    def __init__(self, rt: WorkerRuntime, spec: RequestSpec, prefill: PrefillResult | None,
                 threads: CallThreads) -> None:  # fmt: skip
        self.rt = rt
        self.spec = spec
        self.prefill = prefill
        self._threads = threads
        self._lease_settled = prefill is None or not prefill.lease_id
        self._settling = threading.Lock()
        self._registered = False
        self._registering: Future[KVLoad | None] | None = None
        self._claimed_load = False  # a claimed load no pull has taken: ended on exit
        self._request: Request | None = None
        self._staged: StagedKV | None = None
        self.filled: KVLoad | None = None  # the load the staged KV filled at registration
        self.pulled_bytes = 0  # what a successful pull moved

    async def register(self, on_output: OutputCallback) -> KVLoad | None:
        """Build the request and register it with the engine loop, its outputs to ``on_output``:
        to prefill here, or (after a remote prefill) to continue after the first token with a
        ``KVLoad`` to pull (None when this pool has no room: it recomputes instead). Raises
        ValueError for a bad request or an id in use (then nothing is registered). Runs on the
        registering thread; the exit waits for it, so what it registered is ended also when the
        caller was cancelled meanwhile. Once per call."""
        assert self._registering is None, "a call registers its request once"
        self._registering = self._threads.registers.submit(self._register, on_output)
        return await wait_to_end(self._registering)

    def _register(self, on_output: OutputCallback) -> KVLoad | None:
        spec, rt, prefill = self.spec, self.rt, self.prefill
        req = self._build_request()
        if prefill is None:
            rt.loop.submit(req, on_output)
            self._registered = True
            return None
        # The first token came from the prefill worker; the engine continues after it.
        staged, kv_tensor = self._staged, rt.engine.handover.kv_tensor
        fill = None if staged is None else (lambda load: staged.fill(kv_tensor, load))
        load, filled = rt.loop.submit_remote(req, on_output, RemotePrefill(len(spec.prompt_token_ids),
                                                                           (prefill.first_token,)), fill)  # fmt: skip
        self._registered = True
        self._staged = None  # the buffer's bytes are in the pool now, or of no use
        if filled:
            assert staged is not None and load is not None
            self.filled, self.pulled_bytes = load, staged.stats.num_bytes
            self.settle_lease(pulled=staged.client)
            return None
        self._claimed_load = load is not None
        return load

    async def build(self) -> None:
        """Build the engine's request (its checks raise ValueError), a constraint compiled on the
        ``compiles`` thread; before ``stage`` and ``register``, which then take it as built."""
        if self._request is None and self.spec.params.structured_outputs is not None:
            await run_to_end(self._threads.compiles, self._build_request)
        self._build_request()

    def _build_request(self) -> Request:
        if self._request is None:
            spec = self.spec
            self._request = self.rt.engine.make_request(spec.prompt_token_ids, spec.params, spec.request_id,
                                                        spec.cache_salt)  # fmt: skip
        return self._request

    async def stage(self) -> None:
        """Pull the handed-over KV into a buffer before registering (``decode_worker/staging.py``),
        where it is small enough; on any failure nothing is staged and ``pull`` follows as before.
        Raises ValueError for a bad request (as ``register`` would)."""
        prefill, rt = self.prefill, self.rt
        assert prefill is not None and not self._registered
        if not prefill.lease_id:
            return
        req = self._build_request()
        lease_id = prefill.lease_id

        def work() -> StagedKV | None:
            return pull_staged(rt.engine, rt.client(prefill.address), req, len(self.spec.prompt_token_ids), lease_id)

        try:
            self._staged = await wait_to_end(await self._threads.holders.submit(prefill.address, self._threads.pulls,
                                                                                work))  # fmt: skip
        except TransferError as exc:  # the holder cannot be reached or refuses: the pull will say so
            logger.debug("staged pull of %s from %s failed: %s", req.request_id, prefill.address, exc)
            return
        except Exception:  # noqa: BLE001 - staging only saves time: the pull after registration decides
            logger.exception("staged pull of %s from %s failed; pulling after registration", req.request_id,
                             prefill.address)  # fmt: skip
            return
        if self._staged is not None:
            stats = self._staged.stats
            rt.metrics.transfer_done(stats.num_bytes, stats.num_blocks, stats.seconds, stats.transport)

    async def __aenter__(self) -> DecodeCall:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        # Finished (a no-op then), failed, cancelled or the consumer left: the engine drops the
        # request and its blocks (a load being written keeps them until its finish_load).
        rid, loop, registering = self.spec.request_id, self.rt.loop, self._registering

        def end() -> None:
            wait_futures([registering])  # a registration whose waiter was cancelled may still run
            if not self._registered:  # refused (an id in use elsewhere is not this call's to abort)
                return
            claimed, self._claimed_load = self._claimed_load, False
            loop.abort(rid)
            if claimed:  # after the abort: the load's blocks go back to the pool
                loop.finish_load(rid, False)

        try:
            if registering is not None:
                # After a registration still running (its waiter was cancelled): on its own thread,
                # behind it, so that the ender never waits for one and delays the others' ends.
                await run_to_end(self._threads.ender if registering.done() else self._threads.registers, end)
        finally:  # also when cancelled again while the abort runs
            if not self._lease_settled:
                self.settle_lease(pulled=None)

    def settle_lease(self, pulled: KVTransferClient | None) -> None:
        """Release the prefill worker's lease once (from any thread), without waiting: with the
        client that pulled it when the KV landed, else through the runtime (a failure only means
        it expires)."""
        with self._settling:  # the registering thread and the exit may both come here
            if self._lease_settled:
                return
            self._lease_settled = True
        prefill = self.prefill
        assert prefill is not None and prefill.lease_id is not None
        lease_id = prefill.lease_id

        def release() -> None:
            try:
                if pulled is not None:
                    pulled.release(lease_id)
                else:
                    self.rt.release_lease(prefill.address, lease_id)
            except Exception as exc:  # noqa: BLE001 - the lease expires by itself
                logger.debug("release of lease %s on %s failed: %s", lease_id, prefill.address, exc)

        try:
            self._threads.releases.submit(release)
        except RuntimeError:  # the service is closing: the lease expires by itself
            logger.debug("lease %s on %s left to expire: the service is closing", lease_id, prefill.address)

    async def pull(self, load: KVLoad) -> bool:
        """Fill ``load`` from the prefill worker's lease: True when the KV landed, False when the
        request recomputes its prompt here instead (the pull failed, or the request was aborted
        before it started). The lease is settled either way."""
        prefill, rt, rid = self.prefill, self.rt, self.spec.request_id
        assert prefill is not None
        used: list[KVTransferClient] = []

        def work() -> KVTransferClient | None:
            ok = False
            try:
                if rt.loop.load_aborted(rid):
                    return None  # aborted before the pull began: nothing to write
                client = rt.client(prefill.address)
                used.append(client)
                pulled = pull_kv(client, rt.engine.handover.kv_tensor, load, lease_id=prefill.lease_id)
                rt.metrics.transfer_done(pulled.num_bytes, pulled.num_blocks, pulled.seconds, pulled.transport)
                self.pulled_bytes = pulled.num_bytes
                ok = True
                return client
            finally:
                rt.loop.finish_load(rid, ok)

        assert self._claimed_load, "pull() takes the load its register() claimed, once"
        try:  # cancelled while it waits for a slot of the holder: the claim stays this call's too
            future = await self._threads.holders.submit(prefill.address, self._threads.pulls, work)
        except RuntimeError:  # the service is closing: the claim stays this call's, its exit ends it
            self.settle_lease(pulled=None)
            return False
        # The claim is the pull's from here: ``work`` (and its finish_load) runs to its end.
        self._claimed_load = False
        try:
            client = await wait_to_end(future)
        except TransferError as exc:
            logger.warning("pull of %s from %s failed (%s); recomputing", rid, prefill.address, exc)
            if isinstance(exc, (PeerUnavailableError, LayoutMismatchError)):
                rt.drop_client(prefill.address, used[0] if used else None)
            self._count_failure()
            client = None
        except Exception:  # noqa: BLE001 - a bug in the pull must not fail the request
            logger.exception("pull of %s from %s failed; recomputing", rid, prefill.address)
            self._count_failure()
            client = None
        # The KV is here (or will not come): give the lease back now, beside what follows, so a
        # hung peer cannot delay the recompute.
        self.settle_lease(pulled=client)
        return client is not None

    def _count_failure(self) -> None:
        self.rt.stats.record({"transfer_failures": 1}, self.spec.cache_salt)
        self.rt.metrics.transfer_failed()
