"""The rule every live operation keeps (`proxy.fleet.operations`), in process: a drain or
shrink that would leave no live worker taking new sessions is refused, whichever
operation comes first, before anything changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.mover import Mover
from gym_proxy.proxy.fleet.operations import Operations

pytestmark = pytest.mark.fast


@dataclass
class Route:
    draining: bool = False
    responsive: bool = True


@dataclass(eq=False)
class Worker:
    slot: int
    owner: str
    route: Route = field(default_factory=Route)
    state: str = "live"


class Pool:
    """Slots with a live worker each; nothing here may start or stop one (the rule
    refuses first)."""

    def __init__(self, workers: int) -> None:
        self.slots: list[Worker] = [Worker(i, f"owner-{i}") for i in range(workers)]
        self.config = Config()

    def current(self, slot_index: int) -> Worker | None:
        return self.slots[slot_index] if 0 <= slot_index < len(self.slots) else None

    def workers(self) -> list[Worker]:
        return list(self.slots)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the operation went on to {name}() instead of refusing")


@dataclass
class Exclusion:
    busy: str | None = None
    open_checkpoint: str | None = None


def operations(workers: int, draining: tuple[int, ...] = ()) -> tuple[Operations, Pool]:
    pool = Pool(workers)
    for slot in draining:
        pool.slots[slot].route.draining = True
    exclusion = Exclusion()
    return Operations(pool, Mover(None, exclusion), exclusion), pool  # type: ignore[arg-type]


async def refused(call: Any) -> str:
    with pytest.raises(GymError) as caught:
        await call
    assert caught.value.code == "invalid_request", caught.value
    return caught.value.detail


async def test_a_shrink_after_a_drain_is_refused_naming_the_draining_slot():
    ops, pool = operations(2, draining=(0,))
    detail = await refused(ops.resize(1, 1.0))
    assert detail == (
        "resizing to 1 worker would leave no worker taking new sessions "
        "(slot 0 is draining: undrain it first)"
    )
    assert len(pool.slots) == 2 and ops.checkpoints.busy is None


async def test_a_shrink_is_refused_when_every_slot_it_keeps_is_draining():
    ops, _ = operations(4, draining=(0, 1, 3))
    detail = await refused(ops.resize(2, 1.0))
    assert "(slots 0, 1 are draining: undrain one first)" in detail, detail


async def test_a_drain_of_the_last_worker_taking_sessions_is_refused():
    ops, _ = operations(3, draining=(1, 2))
    detail = await refused(ops.drain(0, 1.0))
    assert detail.startswith("draining slot 0 would leave no worker taking new sessions"), detail
    ops, _ = operations(1)
    assert "(no other live worker)" in await refused(ops.drain(0, 1.0))
