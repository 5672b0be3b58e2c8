"""Turns at the prefill workers, on one asyncio loop: slots bounded, tenants let in in
turn whatever one tenant has queued, a cancelled waiter leaving no trace; and the
ingress's admission, where a tenant within its share gets in while another fills it."""

from __future__ import annotations

import asyncio

import pytest

from pd_cache.cluster.turns import Turns
from pd_cache.front.flow import Admission
from pd_cache.front.http import HTTPError


async def _order(turns: Turns, arrivals: list[str]) -> list[str]:
    """Requests arriving in this order, each holding its slot until the loop turns
    twice; the order in which they got their turn."""
    served: list[str] = []

    async def one(i: int, tenant: str) -> None:
        async with turns.turn(tenant):
            served.append(f"{tenant}{i}")
            assert turns.held <= (turns.slots or len(arrivals))
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    await asyncio.gather(*(one(i, t) for i, t in enumerate(arrivals)))
    assert turns.held == 0 and turns.waiting() == 0
    return served


def test_a_quiet_tenant_waits_a_turn_not_behind_a_flood() -> None:
    flood = ["N"] * 6
    served = asyncio.run(_order(Turns(2), flood + ["Q", "Q"]))
    # N's first two took the slots; then the turn alternates while both wait
    assert served == ["N0", "N1", "N2", "Q6", "N3", "Q7", "N4", "N5"]
    assert asyncio.run(_order(Turns(2), ["", "", "", ""])) == ["0", "1", "2", "3"]
    assert asyncio.run(_order(Turns(0), flood)) == [f"N{i}" for i in range(6)]   # no bound


def test_a_cancelled_waiter_leaves_its_queue_and_a_granted_one_hands_its_slot_on() -> None:
    async def run() -> None:
        turns, gate = Turns(1), asyncio.Event()

        async def hold(tenant: str) -> None:
            async with turns.turn(tenant):
                await gate.wait()

        first = asyncio.create_task(hold("N"))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(hold(t)) for t in ("N", "Q", "Q")]
        await asyncio.sleep(0)
        assert (turns.held, turns.waiting("N"), turns.waiting("Q")) == (1, 1, 2)
        waiters[1].cancel()                       # a client gone while waiting
        await asyncio.sleep(0)
        assert turns.waiting("Q") == 1 and turns.waiting() == 2
        first.cancel()                            # the holder goes: N's waiter is granted...
        waiters[0].cancel()                       # ...and cancelled before it runs
        await asyncio.gather(first, waiters[0], return_exceptions=True)
        await asyncio.sleep(0)
        assert turns.held == 1 and turns.waiting() == 0   # Q's got the slot handed on
        gate.set()
        await waiters[2]
        assert turns.held == 0 and not waiters[2].cancelled()

    asyncio.run(run())
    with pytest.raises(ValueError, match="slots"):
        Turns(-1)


def test_a_tenant_within_its_share_is_admitted_while_another_fills_the_replica() -> None:
    admission = Admission(4)
    flood = [admission.place("N") for _ in range(4)]
    with pytest.raises(HTTPError) as err:
        admission.place("N")
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "1"}
    quiet = [admission.place("Q"), admission.place("Q")]   # its share: 4 // 2 tenants
    with pytest.raises(HTTPError):
        admission.place("Q")
    assert admission.pending == 6 and admission.by_tenant == {"N": 4, "Q": 2}
    for place in flood + quiet:
        with place:
            pass
    assert admission.pending == 0 and not admission.by_tenant
    one = Admission(2)   # open mode is one tenant: the limit as before
    held = [one.place(), one.place()]
    with pytest.raises(HTTPError):
        one.place()
    assert len(held) == 2
