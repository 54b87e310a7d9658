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

Tenants (a request's ``cache_salt``; requests without one share a tenant) share the running
slots fairly: a free slot goes to the waiting request of the tenant with the fewest running
(arrival order among equals), and when every slot is taken while a tenant below its share
(``max_running // tenants with work``, at least 1) waits, the newest request of the tenant
furthest above its share is preempted for it. So no tenant holds more than its share of the
slots while another waits, and a flood delays only its own tenant; with one tenant this is
first come, first served.
"""

from __future__ import annotations

from collections import Counter, deque
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

    @staticmethod
    def tenant(request: Request) -> str:
        return request.cache_salt or ""

    def _running_per_tenant(self) -> Counter[str]:
        return Counter(self.tenant(r) for r in self.running)

    def _fair_pick(self, queue: deque[Request], running: Counter[str]) -> int:
        """Index in ``queue`` of the next request to admit: the first of the tenant with the fewest running."""
        best, best_key = 0, None
        seen: set[str] = set()
        for i, req in enumerate(queue):
            t = self.tenant(req)
            if t in seen:
                continue
            seen.add(t)
            if best_key is None or running[t] < best_key:
                best, best_key = i, running[t]
                if best_key == 0:
                    break
        return best

    def _make_room_for_starved(self, out: SchedulerOutput) -> None:
        """While every slot is taken and a tenant below its fair share waits, preempt the newest
        request of the tenant furthest above its share (it waits at the front of its tenant's line)."""
        waiting = {self.tenant(r) for r in self.waiting} | {self.tenant(r) for r in self.handed_over}
        if not waiting or len(self.running) < self.max_running:
            return
        running = self._running_per_tenant()
        share = max(1, self.max_running // len(waiting | set(running)))
        starved = [t for t in waiting if running[t] < share]
        for _ in starved:
            richest, held = max(running.items(), key=lambda kv: kv[1], default=("", 0))
            if held <= share:
                return
            victim = next(r for r in reversed(self.running) if self.tenant(r) == richest)
            self._preempt(victim, out)
            running[richest] -= 1

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
        self._make_room_for_starved(out)
        fair_preempted = len(out.preempted)
        running = self._running_per_tenant()
        while self.handed_over and len(self.running) < self.max_running:
            i = self._fair_pick(self.handed_over, running)
            req = self.handed_over[i]
            del self.handed_over[i]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            running[self.tenant(req)] += 1
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

        # Admitting while preempting for blocks would only thrash: wait for blocks to come back.
        # (Preempting for fairness frees a slot that the starved tenant takes now.)
        if len(out.preempted) == fair_preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_running:
                i = self._fair_pick(self.waiting, running)
                req = self.waiting[i]
                hit, num_hit = self.kv_manager.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget)
                if self.kv_manager.allocate_slots(req, num_new, num_hit, hit, trim_window=not req.handoff) is None:
                    break
                del self.waiting[i]
                running[self.tenant(req)] += 1
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
