"""Continuous-batching scheduler with a per-step token budget, chunked prefill and preemption.

Each step serves running requests first (decodes and unfinished prefill chunks, in
arrival order), then admits waiting requests while the token budget, ``max_num_seqs``
and the block pool allow. A waiting request first reuses its cached prefix. When a
running request cannot get a block, the newest running request is preempted (its
blocks freed, its progress reset) and put at the front of the waiting queue, so it is
the next admitted: nothing is lost and the oldest work always progresses.

At most ``min(max_num_seqs, max_num_batched_tokens)`` requests run at once, so a budget
smaller than ``max_num_seqs`` cannot leave admitted requests holding blocks without a
token of progress while others decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes
    samples: bool  # this step reaches the end of the request's tokens, so it samples one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Handed-over requests (their KV already in their blocks) waiting for a running slot.
        self.handed_over: deque[Request] = deque()
        self.num_preemptions = 0
        self.max_running = min(config.max_num_seqs, config.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.handed_over)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while self.handed_over and len(self.running) < self.max_running:
            req = self.handed_over.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv_manager.allocate_slots(req, num_new, trim_window=not req.handoff) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    num_new = 0
                    break
            if num_new == 0:
                continue
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens + num_new == req.num_tokens))
            budget -= num_new

        # Admitting while preempting would only thrash: wait for blocks to come back.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_running:
                req = self.waiting[0]
                hit, num_hit = self.kv_manager.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget)
                if self.kv_manager.allocate_slots(req, num_new, num_hit, hit, trim_window=not req.handoff) is None:
                    break
                self.waiting.popleft()
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new, num_hit + num_new == req.num_tokens))
                budget -= num_new
        return out

    def add_running(self, request: Request) -> None:
        """Continue a request whose KV is already in its blocks (handed over by a prefill worker).

        It joins the running set as soon as there is room (``max_running``), ahead of waiting requests.
        """
        self.handed_over.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request and return its blocks, unless it was handed off
        (``FINISHED_HANDED_OFF``): then the KV handover holds them until released."""
        holder = self.running if request in self.running else self.handed_over
        if request in holder:
            holder.remove(request)
            if status != RequestStatus.FINISHED_HANDED_OFF:
                self.kv_manager.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
