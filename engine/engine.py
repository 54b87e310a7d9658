"""LLMEngine: one model, one paged KV cache, a continuous batch.

``add_request`` validates and queues; each ``step`` schedules a batch, runs it and returns what
every request produced. Every block a request takes is returned when it finishes, is aborted or
fails. The KV-handover API (``pdserve.engine.kv_handover``) is how prefill/decode disaggregation
reaches the engine: ``make_request(handoff=True)`` on the producer, ``add_remote`` /
``finish_load`` on the consumer, and ``handover`` for blocks. All public methods hold
``self.lock``, so other threads (a KV-transfer server) may share the engine.
"""

from __future__ import annotations

import logging
import operator
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels.quant import KV_CACHE_DTYPES, is_fp8
from pdserve.engine.kv_budget import DeviceMemory, activation_reserve, check_max_model_len, plan_kv_pool
from pdserve.engine.kv_handover import HeldKV, KVHandover, KVLoad, RemotePrefill
from pdserve.engine.kv_offload import OffloadTier, offload_tiers
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.events import EventSink
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.limits import RequestLimits
from pdserve.engine.model.checkpoint import load_tokenizer
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.dtype import resolve_dtype
from pdserve.engine.model.loader import load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.ranks import RankLauncher, Ranks
from pdserve.engine.parallel.shard import TPShard
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.structured import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (``new_token_ids`` is empty mid-prefill).

    ``finish_reason`` is "stop" or "length", or "handoff" for a request handed off with its KV
    (``kv_handoff`` then says which blocks are held). An aborted request gets no further output.
    ``num_cached_tokens``: prompt tokens found in this engine's prefix cache. ``error``: the
    request failed after its step's forward and was aborted (its output is then finished, empty).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_handoff: HeldKV | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the params ask for them
    error: Exception | None = None  # the request failed in this step (it is aborted): why


@dataclass(frozen=True)
class KVUsage:
    """The pool at a glance: idle means ``free_blocks == num_blocks`` and nothing else."""

    num_blocks: int
    free_blocks: int
    requests: int  # requests holding blocks (running, loading or held)
    held: int  # handed-off requests whose blocks await release


@dataclass(frozen=True)
class EngineStats:
    """Gauges and lifetime counters for metrics. Prefix-cache queries and hits are prompt tokens
    looked up and found (each request counted once, when first admitted)."""

    num_blocks: int
    free_blocks: int
    running: int  # scheduled in the running batch
    waiting: int  # queued or preempted, and handed-over requests waiting for a slot
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # The offload tier (zeros without one): its size and use, tokens restored from it, blocks
    # stored into it, and blocks found changed when loaded.
    offload_blocks: int = 0
    offload_used_blocks: int = 0
    offload_hit_tokens: int = 0
    offload_stored_blocks: int = 0
    offload_corrupted_blocks: int = 0
    # The disk tier behind it (zeros without one): its size and use.
    offload_disk_blocks: int = 0
    offload_disk_used_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Share of the pool's blocks in use (cached free blocks count as free: they can be evicted)."""
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0


def _token_ids(prompt_token_ids: Sequence[int]) -> list[int]:
    """Plain ints from any integer sequence (numpy and 0-d tensor ids too); bools are refused."""
    if isinstance(prompt_token_ids, (str, bytes)):
        raise ValueError("prompt_token_ids: must be a sequence of integer token ids, got a string")
    try:
        items = list(prompt_token_ids)
    except TypeError:
        raise ValueError(
            f"prompt_token_ids: must be a sequence of integer token ids, got {type(prompt_token_ids).__name__}"
        ) from None
    ids: list[int] = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt_token_ids: {t!r} is not an integer token id") from None
    return ids


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None,
                 on_rank_lost: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """``on_rank_lost``: with tensor parallelism, called once with the reason when one of the
        engine's other ranks is lost: it exited, or a step failed on the group (a rank hung past
        ``collective_timeout_s``) (``engine/parallel/ranks.py``); the engine cannot step again.

        A build that fails ends what it started (the ranks, the tier's file) and gives the process
        its CPU threads back before it raises."""
        # What close() gives back, set before anything is started: close() ends whatever exists.
        self.tier: OffloadTier | None = None
        self.ranks: Ranks | None = None
        self._threads_before: int | None = None  # this process's CPU threads before its ranks took a share
        self.lock = threading.RLock()
        try:
            self._build(config, event_sink, on_rank_lost)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, event_sink: EventSink | None,
               on_rank_lost: Callable[[str], None] | None) -> None:  # fmt: skip
        """The engine's parts, in order; what needs ending is on ``self`` as soon as it is started."""
        if config.model is None:
            raise ValueError("EngineConfig.model: no model given")
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = mc = ModelConfig.from_path(config.model)
        # auto: bfloat16 on CUDA, and on a CPU with bfloat16 matrix units for a reduced-precision checkpoint.
        self.dtype_choice = resolve_dtype(config.dtype, config.model, mc, self.device)
        self.tokenizer = load_tokenizer(config.model, config.chat_template)
        if config.seed is not None:  # vLLM's --seed: requests without a seed of their own draw from this
            torch.manual_seed(config.seed)
        # EOS: the model config's, and generation_config.json's where it names more (Llama 3 instruct).
        self.eos_token_ids = tuple(dict.fromkeys(
            (*mc.eos_token_ids, *self.tokenizer.info.generation_eos_token_ids)))  # fmt: skip
        tp = config.parallel.tensor_parallel_size
        self._on_rank_lost = on_rank_lost
        # Cascade attention (the torch path's shared-prefix decodes), where its layout has K/V heads.
        self.cascade = not config.disable_cascade_attn and mc.kv_cache_kind == "mha"
        if tp > 1 and self.device.type != "cpu":
            raise ValueError(f"tensor_parallel_size={tp}: tensor parallelism runs on the CPU (gloo) in this version; "
                             f"use tensor_parallel_size=1 on {self.device}")  # fmt: skip
        self.model = load_model(config.model, dtype=self.dtype_choice.dtype, device=self.device,
                                shard=TPShard(0, tp))  # fmt: skip
        self.dtype = next(self.model.parameters()).dtype
        self.onednn = config.cpu_onednn and self.model.pack_onednn(config.cpu_fp32_gemm)
        logger.info("dtype %s (%s)%s", self.dtype_choice.name, self.dtype_choice.why,
                    "; projections through packed weights (engine/model/linear.py)" if self.onednn else "")  # fmt: skip
        cc = config.cache
        # An FP8 cache stores one byte per value (KV_CACHE_DTYPES), read back with per-layer scales.
        cache_dtype = KV_CACHE_DTYPES[cc.kv_cache_dtype] or self.dtype
        if cache_dtype == torch.float8_e4m3fn and self.device.type == "cuda" \
                and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"kv_cache_dtype {cc.kv_cache_dtype!r} (e4m3) needs a GPU of compute capability 8.9 or "
                             "newer (Ada, Hopper); use 'fp8_e5m2' on this one")  # fmt: skip
        scales = self.model.kv_scales(quantized=is_fp8(cache_dtype))
        layout = KVLayout(mc.num_hidden_layers, mc.kv_cache_heads, mc.kv_cache_head_dim, cc.block_size, cache_dtype,
                          scales, kind=mc.kv_cache_kind, rope_dim=mc.kv_cache_rope_dim)  # fmt: skip
        num_blocks = self._plan_pool(layout)
        self.limits = RequestLimits.for_engine(mc, config, num_blocks)
        self.max_model_len = self.limits.max_model_len
        self.kv_tensor = KVTensor(layout, num_blocks, self.device, shared=tp > 1)
        # The tier before the ranks: a tier that cannot be made (its size, its disk) fails the
        # build before any rank is started.
        if cc.kv_offload_gb > 0:
            self.tier = offload_tiers(cc, layout.block_nbytes, event_sink, pin_memory=self.device.type == "cuda")
        if tp > 1:
            self._start_ranks(layout, num_blocks)
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        self.kv_manager = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, medium, event_sink, mc.sliding_window
        )
        if self.tier is not None:
            tier = self.tier

            def offload(block_id: int, block_hash: bytes) -> None:
                tier.store(block_hash, self.kv_tensor.block_bytes(block_id))

            self.kv_manager.pool.eviction_sink = offload
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_tensor, cc.block_size, self.ranks,
                                  cascade=self.cascade)  # fmt: skip
        # Compiles structured-output constraints (once each) on the first request that has one.
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.handover = KVHandover(self.kv_manager, self.kv_tensor, self.lock)
        self.handover.tier = self.tier
        self.requests: dict[str, Request] = {}
        self._loading: dict[str, tuple[Request, KVLoad, RemotePrefill]] = {}
        self._aborted_loads: set[str] = set()
        self._writing_loads: set[str] = set()  # loads a writer claimed with begin_load
        self.num_tier_hit_tokens = 0  # prompt tokens restored from the offload tier (lifetime)
        self.driver: object | None = None  # what steps this engine (an EngineLoop), if not its caller

    @property
    def layout(self) -> KVLayout:
        return self.kv_tensor.layout

    # -- requests ---------------------------------------------------------------------------
    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        handoff: bool = False,
    ) -> Request:
        """Validate a prompt and build its Request (not queued). Errors name the field.

        ``handoff``: see ``Request``; the request's output then carries its ``HeldKV``.
        A structured-output constraint is compiled here (unless an equal one was recently):
        ``ConstraintError`` (a ValueError) when it cannot be.
        """
        ids = _token_ids(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        self.limits.check(ids, params.max_tokens)
        rid = request_id or uuid.uuid4().hex
        self._check_id_free(rid)
        so = params.structured_outputs
        return Request(
            rid, ids, params, self.layout.block_size, hash_seed=self.config.cache.hash_seed, cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, handoff=handoff,
            grammar=None if so is None else self.structured.state(so),
        )  # fmt: skip

    def _check_id_free(self, request_id: str) -> None:
        """A request id names one request at a time (outputs and blocks are looked up by it)."""
        if request_id in self.requests or self.kv_manager.get_blocks(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        with self.lock:
            req = self.make_request(prompt_token_ids, params, request_id, cache_salt)
            self.enqueue(req)
            return req

    def enqueue(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request` (ValueError if its id became live since).
        With an offload tier, the part of its prefix found there is restored into the pool first."""
        with self.lock:
            self._check_id_free(request.request_id)
            self._restore_prefix(request)
            self.requests[request.request_id] = request
            if request.grammar is not None:
                self.runner.sampler.constrain(request.request_id, request.grammar)
            self.scheduler.add(request)

    def _restore_prefix(self, request: Request) -> None:
        """Bring back from the offload tier the blocks of ``request``'s prefix that follow its pool
        hits (leaving at least one prompt token to compute), through the KV-handover API, as cached
        blocks of the pool: admission (or ``reserve``) then finds them as prefix hits. Nothing
        happens without a tier hit or room; a tier block whose bytes changed is dropped and the
        prompt computed. Caller holds the lock."""
        if self.tier is None:
            return
        bs = self.layout.block_size
        hashes = request.block_hashes
        max_blocks = (request.num_tokens - 1) // bs
        hit, _ = self.kv_manager.get_computed_blocks(request)
        n = min(self.tier.match(hashes[len(hit) : max_blocks]), self.kv_manager.num_free_blocks())
        corrupted = self.tier.num_corrupted
        if n and self.handover.restore_from_tier(hashes[len(hit) : len(hit) + n], keep=hashes[: len(hit)]):
            self.num_tier_hit_tokens += n * bs
        elif self.tier.num_corrupted > corrupted:
            logger.warning("request %s: an offload-tier block had changed or could not be read; its prompt is "
                           "computed instead", request.request_id)  # fmt: skip

    def add_remote(self, request: Request, remote: RemotePrefill) -> KVLoad | None:
        """Continue ``request`` (built by :meth:`make_request`) after another engine prefilled it.

        Returns where its KV must be written: a writer claims it with :meth:`begin_load` and, when
        that returned True, ends it with exactly one :meth:`finish_load`. Returns None when this pool
        has no room for it now: the request is then queued to recompute its prompt here (after the
        tokens sampled elsewhere), and no load follows.
        """
        with self.lock:
            self._check_id_free(request.request_id)
            if remote.num_tokens != request.num_prompt_tokens:
                raise ValueError(f"remote prefill of {remote.num_tokens} tokens for a {request.num_prompt_tokens}-token prompt")
            self._restore_prefix(request)  # what this worker's tier holds is not pulled
            load = self.handover.reserve(request, remote.num_tokens)
            self.requests[request.request_id] = request
            try:
                self._append_remote_output(request, remote)
            except BaseException:
                self.requests.pop(request.request_id)
                if load is not None:
                    self.handover.complete(request, load, ok=False)
                raise
            if request.grammar is not None:  # advanced over the tokens sampled elsewhere by now
                self.runner.sampler.constrain(request.request_id, request.grammar)
            if load is None:
                self.scheduler.add(request)
                return None
            request.status = RequestStatus.WAITING_FOR_KV
            self._loading[request.request_id] = (request, load, remote)
            return load

    def _append_remote_output(self, request: Request, remote: RemotePrefill) -> None:
        """The tokens sampled elsewhere become the request's first outputs (advancing its grammar,
        if it has one); a seeded sampler skips the draws they took, so the stream continues as if
        sampled here."""
        for tok in remote.output_token_ids:
            if not 0 <= tok < self.model_config.vocab_size:
                raise ValueError(f"output token {tok} is outside the vocabulary")
            request.append_output_token(tok)
            if request.check_stop() is not None:
                raise ValueError(f"request {request.request_id!r} already finished with token {tok}")
        self.runner.sampler.skip_draws(
            request.request_id, request.sampling_params, self.model_config.vocab_size, self.device,
            len(remote.output_token_ids),
        )  # fmt: skip

    def begin_load(self, request_id: str) -> bool:
        """Claim the load of :meth:`add_remote` for writing; False when the request was aborted
        before (its blocks are back in the pool then, and nothing may be written). After True,
        the writer must call :meth:`finish_load`, and an abort waits for it: so a load ends
        exactly once whether its writer starts, never starts, or the request goes first."""
        with self.lock:
            if request_id not in self._loading or request_id in self._aborted_loads:
                return False
            self._writing_loads.add(request_id)
            return True

    def cached_prefix_hint(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first, this pool's prefix cache holds now, read
        without the lock (a step may hold it): a guess that may be stale once the lock is taken."""
        return self.kv_manager.num_cached_prefix(block_hashes)

    def load_aborted(self, request_id: str) -> bool:
        """Whether the request of a load claimed with :meth:`begin_load` was aborted since. Read
        without the lock (a step may hold it): a stale False only means a write that
        :meth:`finish_load` then discards."""
        return request_id in self._aborted_loads

    def finish_load(self, request_id: str, ok: bool) -> None:
        """The load claimed by :meth:`begin_load` ended: ``ok`` means every block of it was
        written. The request then runs from that KV; otherwise it recomputes. If it was aborted
        meanwhile, its blocks go back to the pool now."""
        with self.lock:
            if request_id not in self._writing_loads:
                raise ValueError(f"request {request_id!r} has no KV load being written")
            self._writing_loads.discard(request_id)
            request, load, _ = self._loading.pop(request_id)
            aborted = request_id in self._aborted_loads
            self._aborted_loads.discard(request_id)
            self.handover.complete(request, load, ok and not aborted)
            if aborted:
                return
            if ok:
                request.num_cached_tokens = load.num_local_hit_tokens
                self.scheduler.add_running(request)
            else:
                self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request and return its blocks; False if it is unknown or already finished.

        A request whose KV a writer is loading keeps its blocks until ``finish_load`` (they may
        be being written); one whose load no writer claimed yet frees them now. A handed-off
        request's blocks are freed by ``handover.release``.
        """
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            self.runner.sampler.forget(request_id)
            if request_id in self._loading:
                req.status = RequestStatus.FINISHED_ABORTED
                if request_id in self._writing_loads:
                    self._aborted_loads.add(request_id)
                else:
                    request, load, _ = self._loading.pop(request_id)
                    self.handover.complete(request, load, ok=False)
                return True
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Give back what the engine holds beyond memory: its disk tier's file (and the space
        reserved for it), its tensor-parallel ranks, and the CPU threads they took a share of. Call
        it when done with the engine; idempotent, and safe on an engine whose build failed."""
        with self.lock:
            if self.tier is not None:
                self.tier.close()
            if self.ranks is not None:
                self.ranks.close()
                self.ranks.fail("the engine was closed", log=False)
            if self._threads_before is not None:
                torch.set_num_threads(self._threads_before)
                self._threads_before = None

    def _start_ranks(self, layout: KVLayout, num_blocks: int) -> None:
        """Ranks 1..N-1 of a tensor-parallel engine (:attr:`ranks`), each with its shard loaded,
        joined with this process (rank 0) in one group. Child processes share out this process's CPU
        threads (it keeps its share; :meth:`close` gives them back); Ray actors each have a bundle's
        CPUs, as many as this process's."""
        parallel = self.config.parallel
        size = parallel.tensor_parallel_size
        launcher: RankLauncher
        if parallel.distributed_executor_backend == "ray":
            from pdserve.engine.parallel.rank_actors import ActorLauncher

            launcher = ActorLauncher()
        else:
            from pdserve.engine.parallel.rank_processes import ProcessLauncher

            launcher = ProcessLauncher()
        before = torch.get_num_threads()
        threads = max(1, before // size) if launcher.shares_cpus else before
        self._threads_before = before  # given back by close(), also when the build fails from here on
        torch.set_num_threads(threads)
        spec = {
            "model": self.config.model, "dtype": str(self.dtype).removeprefix("torch."), "onednn": self.onednn,
            "fp32_gemm": self.config.cpu_fp32_gemm,
            "quantized": bool(layout.kv_scales), "threads": threads, "num_blocks": num_blocks, "cascade": self.cascade,
            "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                       "head_dim": layout.head_dim, "block_size": layout.block_size,
                       "dtype": str(layout.dtype).removeprefix("torch."), "kv_scales": list(layout.kv_scales),
                       "kind": layout.kind, "rope_dim": layout.rope_dim},
        }  # fmt: skip
        # Ranks() ends every rank it started when it fails; once it returns, close() ends them.
        self.ranks = Ranks(launcher, spec, self.kv_tensor, size, parallel.collective_timeout_s,
                           parallel.start_timeout_s, self._on_rank_lost)  # fmt: skip
        self.model.join(self.ranks.group)
        logger.info("tensor parallel: %d ranks (%s), %d CPU thread(s) each", size,
                    parallel.distributed_executor_backend, threads)  # fmt: skip

    def _plan_pool(self, layout: KVLayout) -> int:
        """The KV pool's block count (engine/kv_budget.py); KVBudgetError when a budget cannot hold one
        request of max_model_len tokens."""
        config, mc, cc = self.config, self.model_config, self.config.cache
        unbounded = RequestLimits.for_engine(mc, config)
        need = unbounded.blocks_needed(unbounded.max_model_len - 1, 1)
        device_memory = None
        if self.device.type == "cuda":
            def device_memory() -> DeviceMemory:
                free, total = torch.cuda.mem_get_info(self.device)
                return DeviceMemory(free, total)

        plan = plan_kv_pool(cc.num_blocks, cc.kv_cache_memory_bytes, cc.gpu_memory_utilization, layout.block_nbytes,
                            need, device_memory, activation_reserve(
                                mc.hidden_size, mc.intermediate_size, mc.vocab_size,
                                config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                self.dtype.itemsize))  # fmt: skip
        num_blocks = max(1, plan.num_blocks)
        usable = RequestLimits.for_engine(mc, config, num_blocks).usable_len
        check_max_model_len(plan, unbounded.max_model_len, need, usable, cc.block_size, layout.block_nbytes)
        logger.info("KV cache: %d blocks of %d tokens (%s)", num_blocks, cc.block_size, plan.source)
        return num_blocks

    def kv_usage(self) -> KVUsage:
        with self.lock:
            m = self.kv_manager
            return KVUsage(m.num_blocks, m.num_free_blocks(), len(m.req_to_blocks), self.handover.num_held)

    def stats(self) -> EngineStats:
        with self.lock:
            m, sched = self.kv_manager, self.scheduler
            offload: dict[str, int] = {}
            if self.tier is not None:
                t = self.tier.stats()
                offload = dict(offload_blocks=t.num_blocks, offload_used_blocks=t.used_blocks,
                               offload_hit_tokens=self.num_tier_hit_tokens, offload_stored_blocks=t.stored,
                               offload_corrupted_blocks=self.tier.num_corrupted)  # fmt: skip
                if self.tier.spill is not None:
                    d = self.tier.spill.stats()
                    offload.update(offload_disk_blocks=d.num_blocks, offload_disk_used_blocks=d.used_blocks)
            return EngineStats(
                m.num_blocks, m.num_free_blocks(), len(sched.running), len(sched.waiting) + len(sched.handed_over),
                sched.num_preemptions, m.stats.queries, m.stats.hits, **offload,
            )  # fmt: skip

    # -- stepping ---------------------------------------------------------------------------
    def _step_output(self, req: Request, num_new_tokens: int,
                     sample: tuple[int, TokenLogprobs | None] | None) -> RequestOutput:  # fmt: skip
        """``req``'s output of the step that computed ``num_new_tokens`` of it and sampled
        ``sample`` (None mid-prefill); a request this finishes leaves the scheduler."""
        req.num_computed_tokens += num_new_tokens
        new: list[int] = []
        status = None
        held = None
        new_logprobs = None
        if sample is not None:
            tok, lp = sample
            new_logprobs = None if lp is None else [lp]
            req.append_output_token(tok)
            new.append(tok)
            status = req.check_stop()
            if status is None and req.handoff:
                status = RequestStatus.FINISHED_HANDED_OFF
        if status is not None:
            if status is RequestStatus.FINISHED_HANDED_OFF:  # held before it leaves the scheduler
                held = self.handover.hold(req, req.num_prompt_tokens)
            self.scheduler.finish(req, status)
            self.requests.pop(req.request_id, None)
            self.runner.sampler.forget(req.request_id)
        assert req.num_cached_tokens is not None  # set when it was first scheduled
        return RequestOutput(
            req.request_id, new, status is not None, status.value if status else None,
            req.num_prompt_tokens, req.num_cached_tokens, held, new_logprobs,
        )  # fmt: skip

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; one output per request it scheduled. A failed forward aborts
        the batch and raises; a request that fails after it (its output, its stop check) is
        aborted alone and gets an output whose ``error`` says why."""
        with self.lock:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            block_ids = [self.kv_manager.get_block_ids(s.request.request_id) for s in out.scheduled]
            try:
                tokens, logprobs = self.runner.execute(out.scheduled, block_ids)
            except BaseException:
                # A failed forward must not strand blocks, nor leave cached hashes on blocks
                # whose KV it never wrote: uncache this step's blocks, abort the batch.
                for s in out.scheduled:
                    self.kv_manager.uncache_blocks(s.request, s.request.num_computed_tokens)
                    self.abort(s.request.request_id)
                raise
            outputs: list[RequestOutput] = []
            sampled = iter(zip(tokens, logprobs))
            for s in out.scheduled:
                sample = next(sampled) if s.samples else None
                try:
                    outputs.append(self._step_output(s.request, s.num_new_tokens, sample))
                except Exception as exc:  # noqa: BLE001 - this request's alone: the batch goes on
                    # (e.g. a token its grammar refuses): it ends with the error, its blocks go back.
                    logger.exception("request %s failed after its step", s.request.request_id)
                    self.abort(s.request.request_id)
                    req = s.request
                    outputs.append(RequestOutput(req.request_id, [], True, None, req.num_prompt_tokens,
                                                 req.num_cached_tokens or 0, error=exc))  # fmt: skip
            self.handover.blocks_cached()  # this step's full blocks are written: readers waiting may take them
            return outputs
