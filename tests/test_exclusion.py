"""The one exclusion of checkpoints and live operations (`coordinator.exclusion`): what
waits for it is woken as it becomes free, by an operation's end or a checkpoint's."""

from __future__ import annotations

import asyncio
import time

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.coordinator.phases import PhaseMachine

pytestmark = pytest.mark.fast


async def test_a_waiter_is_woken_as_the_operation_ends():
    exclusion = Exclusion(lambda: None)
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
    machine = PhaseMachine(lease_grace=5.0)
    exclusion = Exclusion(lambda: machine.checkpoint_id if machine.is_open else None)
    machine.on_idle = exclusion.freed
    machine.open("ck", "preparing", time.time() + 60)
    waiting = asyncio.ensure_future(exclusion.until_free(60))
    await asyncio.sleep(0)
    assert not waiting.done()
    machine.close()  # a resume
    assert await asyncio.wait_for(waiting, 1) is True


async def test_a_wait_that_is_not_freed_in_time_says_so():
    exclusion = Exclusion(lambda: "ck")
    assert await exclusion.until_free(0.01) is False
    assert exclusion._waiting == []
    assert await Exclusion(lambda: None).until_free(0) is True
