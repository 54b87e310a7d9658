"""Admission: bounded in-flight and queue, a fair share per tenant, refusals at once, draining."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.admission import Admission, Draining, Overloaded


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_a_flooding_tenant_waits_behind_its_own_requests_not_others() -> None:
    async def main() -> list[str]:
        adm = Admission(max_in_flight=2, max_per_tenant=2, max_queued=100, queue_timeout_s=30)
        order: list[str] = []
        gate = asyncio.Event()

        async def request(tenant: str, name: str) -> None:
            async with adm.slot(tenant):
                order.append(name)
                await gate.wait()

        flood = [asyncio.ensure_future(request("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)
        assert (adm.in_flight, adm.queued) == (2, 4)
        other = asyncio.ensure_future(request("b", "b0"))
        await asyncio.sleep(0)
        gate.set()  # every slot that frees goes to the tenants in turn: b0 right after a0, a1
        await asyncio.gather(*flood, other)
        assert adm.in_flight == 0 and adm.queued == 0
        return order

    order = run(main())
    assert order[:3] == ["a0", "a1", "b0"]


def test_one_tenant_never_holds_more_than_its_share() -> None:
    async def main() -> None:
        adm = Admission(max_in_flight=8, max_per_tenant=3, max_queued=100, queue_timeout_s=30)
        gate = asyncio.Event()
        peak: dict[str, int] = {}

        async def request(tenant: str) -> None:
            async with adm.slot(tenant):
                peak[tenant] = max(peak.get(tenant, 0), adm.running[tenant])
                await gate.wait()

        tasks = [asyncio.ensure_future(request("a")) for _ in range(10)] + [asyncio.ensure_future(request("b"))]
        await asyncio.sleep(0)
        assert adm.running["a"] == 3 and adm.running["b"] == 1  # b got in although a has 7 waiting
        gate.set()
        await asyncio.gather(*tasks)
        assert peak == {"a": 3, "b": 1}

    run(main())


def test_full_queue_and_queue_timeout_refuse_at_once() -> None:
    async def main() -> None:
        adm = Admission(max_in_flight=1, max_per_tenant=1, max_queued=1, queue_timeout_s=0.2)
        gate = asyncio.Event()

        async def request() -> None:
            async with adm.slot(""):
                await gate.wait()

        holder = asyncio.ensure_future(request())
        waiter = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="too many requests waiting"):
            async with adm.slot(""):
                pass
        with pytest.raises(Overloaded, match="waited"):
            await waiter  # nobody freed the slot in time
        assert adm.queued == 0 and adm.refused == 2
        gate.set()
        await holder
        assert adm.in_flight == 0

    run(main())


def test_a_cancelled_waiter_leaves_no_trace_and_drain_refuses_new_requests() -> None:
    async def main() -> None:
        adm = Admission(max_in_flight=1, max_per_tenant=1, max_queued=10, queue_timeout_s=30)
        gate = asyncio.Event()

        async def request() -> None:
            async with adm.slot("t"):
                await gate.wait()

        holder = asyncio.ensure_future(request())
        waiter = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.queued == 0
        adm.drain()
        with pytest.raises(Draining):
            async with adm.slot("t"):
                pass
        assert not await adm.wait_idle(0.05)  # the running request carries on
        gate.set()
        assert await adm.wait_idle(5)
        await holder

    run(main())


def test_a_full_queue_is_shared_fairly_between_tenants() -> None:
    """A flooding tenant fills every waiting place; another tenant's requests then take places of
    the flooder's newest waiters (refused), until both wait as many; then new requests are refused."""
    async def main() -> None:
        adm = Admission(max_in_flight=1, max_per_tenant=1, max_queued=6, queue_timeout_s=30)
        gate = asyncio.Event()
        order: list[str] = []

        async def request(tenant: str, name: str) -> None:
            async with adm.slot(tenant):
                order.append(name)
                await gate.wait()

        holder = asyncio.ensure_future(request("a", "a-run"))
        await asyncio.sleep(0)
        flood = [asyncio.ensure_future(request("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)
        assert adm.queued == 6
        others = [asyncio.ensure_future(request("b", f"b{i}")) for i in range(4)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # b took three places (a's newest three were refused); its fourth found the shares even.
        assert dict((t, len(q)) for t, q in adm._waiting.items()) == {"a": 3, "b": 3}
        refused = [*flood[3:], others[3]]
        await asyncio.wait(refused, timeout=30)
        assert [t for t in flood + others if t.done()] == refused
        for t in refused:
            with pytest.raises(Overloaded, match="too many requests waiting"):
                t.result()
        assert adm.refused == 4
        gate.set()
        await asyncio.gather(holder, *flood[:3], *others[:3])
        assert adm.in_flight == 0 and adm.queued == 0
        assert sorted(order) == sorted(["a-run", "a0", "a1", "a2", "b0", "b1", "b2"])

    run(main())


def test_no_waiting_places_refuses_at_once() -> None:
    async def main() -> None:
        adm = Admission(max_in_flight=1, max_per_tenant=1, max_queued=0, queue_timeout_s=30)
        gate = asyncio.Event()

        async def request(tenant: str) -> None:
            async with adm.slot(tenant):
                await gate.wait()

        holder = asyncio.ensure_future(request("a"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            async with adm.slot("b"):
                pass
        gate.set()
        await holder

    run(main())
