"""The one exclusion of checkpoints and live operations (`coordinator.exclusion`): what
waits for it is woken as it becomes free, by an operation's end or a checkpoint's; one
of gym-proxy's own (it yields) is asked to give way, and its waits end on the ask; an
operator's is never asked."""

from __future__ import annotations

import asyncio
import time

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.phases import PhaseMachine
from gym_proxy.proxy.data_path.routing import Router
from gym_proxy.proxy.fleet.moves.session_watch import until_a_request_ends

pytestmark = pytest.mark.fast


async def test_a_waiter_is_woken_as_the_operation_ends():
    exclusion = Exclusion()
    with exclusion.hold("drain"):
        waiting = asyncio.ensure_future(exclusion.until_free(60))
        await asyncio.sleep(0)
        assert not waiting.done()
        with pytest.raises(GymError, match="a drain is running"):
            exclusion.refuse_checkpoint()
    started = time.monotonic()
    assert await asyncio.wait_for(waiting, 1) is True
    assert time.monotonic() - started < 0.5 and exclusion._waiting == []


async def test_a_waiter_is_woken_as_the_checkpoint_goes_back_to_idle():
    exclusion = Exclusion()
    machine = PhaseMachine(
        lease_grace=5.0, on_open=exclusion.checkpoint_opened, on_idle=exclusion.checkpoint_closed
    )
    machine.open("ck", "preparing", time.time() + 60)
    assert exclusion.open_checkpoint() == "ck"
    waiting = asyncio.ensure_future(exclusion.until_free(60))
    await asyncio.sleep(0)
    assert not waiting.done()
    machine.close()  # a resume
    assert await asyncio.wait_for(waiting, 1) is True


async def test_a_wait_that_is_not_freed_in_time_says_so():
    exclusion = Exclusion(checkpoint="ck")
    assert await exclusion.until_free(0.01) is False
    assert exclusion._waiting == []
    assert await Exclusion().until_free(0) is True


async def test_one_that_yields_is_asked_to_give_way_and_waited_for():
    """A checkpoint's prepare (`give_way`, then its refusal check) finds a rebalance or an
    autoscale resize running: the one that yields is asked, its wait for a session's
    boundary ends at once, and the prepare goes on when it let go; never refused."""
    exclusion = Exclusion()
    router = Router()
    stopped: list[float] = []

    async def autoscale() -> None:
        with exclusion.hold("resize", yields=True):
            assert exclusion.asked is not None and not exclusion.giving_way
            started = time.monotonic()
            await until_a_request_ends(router, ["busy"], started + 60, exclusion.asked)
            assert exclusion.giving_way
            stopped.append(time.monotonic() - started)
        assert exclusion.asked is None and not exclusion.giving_way

    running = asyncio.ensure_future(autoscale())
    await asyncio.sleep(0)
    await asyncio.wait_for(exclusion.give_way(), 1)
    exclusion.refuse_checkpoint()  # nothing in the way any more
    await running
    assert stopped[0] < 0.5 and router.watchers == {}


async def test_one_that_yields_and_begins_while_the_asker_waits_is_asked_in_turn():
    exclusion = Exclusion()
    asked: list[str] = []

    async def own(kind: str, then: str | None) -> None:
        with exclusion.hold(kind, yields=True):
            assert exclusion.asked is not None
            await exclusion.asked
            asked.append(kind)
        if then is not None:  # the next round begins before the asker wakes
            await own(then, None)

    running = asyncio.ensure_future(own("rebalance", "resize"))
    await asyncio.sleep(0)
    await asyncio.wait_for(exclusion.give_way(), 1)
    exclusion.refuse_checkpoint()
    await running
    assert asked == ["rebalance", "resize"]


async def test_an_operators_operation_is_not_asked_and_refuses():
    exclusion = Exclusion()
    with exclusion.hold("resize"):
        assert exclusion.asked is None
        await asyncio.wait_for(exclusion.give_way(), 1)  # returns at once
        with pytest.raises(GymError, match="a resize is running"):
            exclusion.refuse_checkpoint()


async def test_acquire_asks_what_yields_then_holds_and_refuses_what_does_not():
    """One call gives way, refuses and holds (`acquire`): an operator's drain asks a
    running rebalance to give way and then holds the exclusion; a second operator's
    operation is refused while it does; gym-proxy's own never pushes another aside."""
    exclusion = Exclusion()
    rebalancing = asyncio.Event()

    async def rebalance() -> None:
        async with exclusion.acquire("rebalance", yields=True):
            rebalancing.set()
            asked = exclusion.asked
            assert asked is not None
            await asked  # its waits end on it

    running = asyncio.ensure_future(rebalance())
    await rebalancing.wait()
    async with exclusion.acquire("drain"):
        assert running.done() and exclusion.operation == "drain"
        with pytest.raises(GymError, match="a drain is running"):
            async with exclusion.acquire("resize"):
                pass
        with pytest.raises(GymError, match="a drain is running"):
            async with exclusion.acquire("rebalance", yields=True):
                pass
        with pytest.raises(GymError, match="a drain is running"):
            await exclusion.admit_checkpoint()
        assert await exclusion.blocking_take_over() == "a drain is running; take over after it"
    assert exclusion.operation is None and await exclusion.blocking_take_over() is None
