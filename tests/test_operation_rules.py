"""The rules of the live operations, in process: a drain or shrink that would leave no
live worker taking new sessions is refused, whichever operation comes first, before
anything changes (`proxy.fleet.operations.live`); an operation's steps and a worker's status
are data, and the manual lists them as the code has them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.data_path.routing import WorkerRoute
from gym_proxy.proxy.fleet.moves.mover import Mover
from gym_proxy.proxy.fleet.operations.decommission import Step
from gym_proxy.proxy.fleet.operations.live import Operations
from gym_proxy.proxy.fleet.supervision.worker_records import WORKER_STATUSES, WorkerProcess
from tests.support import REPO

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

    @property
    def live_route(self) -> Route:
        return self.route


class Slots(list[Worker]):
    """The slot table as the operations read it (`proxy.fleet.supervision.slots.Slots`)."""

    def current(self, slot_index: int) -> Worker | None:
        return self[slot_index] if 0 <= slot_index < len(self) else None

    def workers(self) -> list[Worker]:
        return list(self)


class Pool:
    """Slots with a live worker each; nothing here may start or stop one (the rule
    refuses first)."""

    def __init__(self, workers: int) -> None:
        self.slots = Slots(Worker(i, f"owner-{i}") for i in range(workers))
        self.config = Config()

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the operation went on to {name}() instead of refusing")


def operations(workers: int, draining: tuple[int, ...] = ()) -> tuple[Operations, Pool]:
    pool = Pool(workers)
    for slot in draining:
        pool.slots[slot].route.draining = True
    exclusion = Exclusion()  # no checkpoint open
    # Stand-ins that fail any use: a rule refuses before it touches the pool or the mover.
    return Operations(pool, Mover(None, None, exclusion), exclusion), pool  # type: ignore[arg-type]


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
    assert len(pool.slots) == 2 and ops.exclusion.operation is None


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


def test_the_steps_the_manual_lists_are_the_codes():
    manual = (REPO / "docs" / "live_operations.md").read_text()
    listed = re.search(r"The `step` is one of\s+(.*?)\(`proxy\.fleet", manual, re.S)
    assert listed is not None
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(get_args(Step))


def _worker(state: str = "live", **route: Any) -> WorkerProcess:
    process = SimpleNamespace(pid=4242)  # no process: the rules read only its pid
    worker = WorkerProcess(0, "owner", "/sock", process, 0.0, state=state)  # type: ignore[arg-type]
    if state != "starting":
        worker.route = WorkerRoute("owner", 0, "/sock", **route)
    return worker


@pytest.mark.parametrize(
    ("state", "route", "status"),
    [
        ("starting", {}, "booting"),
        ("dead", {"draining": True}, "stopped"),
        ("live", {"draining": True, "responsive": False}, "draining"),
        ("live", {"responsive": False}, "unresponsive"),
        ("live", {}, "ready"),
    ],
)
async def test_a_workers_status_is_the_first_that_holds(state, route, status):
    assert _worker(state, **route).status == status
    assert status in WORKER_STATUSES


async def test_a_leaving_worker_is_leaving_whatever_else_holds():
    worker = _worker(draining=True, responsive=False)
    worker.leaving = True
    assert worker.status == "leaving"


async def test_a_worker_that_has_not_registered_has_no_live_route_or_channel():
    worker = _worker("starting")
    with pytest.raises(RuntimeError, match=r"worker 0 \(pid 4242\) has not registered"):
        worker.live_route  # noqa: B018
    with pytest.raises(RuntimeError, match="has not registered"):
        worker.live_channel  # noqa: B018
