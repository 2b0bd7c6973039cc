"""A move's and a hand-over's wait for a session's requests, in process on the data path
rig: the data path wakes the waiter as a request of a watched session ends, and the
waiter leaves nothing registered behind (`proxy.fleet.moves.session_watch`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gym_proxy.proxy.fleet.moves.session_watch import until_a_request_ends, worker_watch
from tests.data_path_rig import Rig, Upstream

pytestmark = pytest.mark.fast

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


async def running_session(rig: Rig) -> tuple[str, Upstream]:
    """A request of a new session, running at its worker: (session ID, its upstream)."""
    before = set(rig.router.active)
    rig.client().send(b"POST /seed_session HTTP/1.1\r\nHost: t\r\ncontent-length: 2\r\n\r\n{}")
    upstream = await rig.upstream()
    [session_id] = set(rig.router.active) - before
    return session_id, upstream


async def test_the_end_of_a_watched_request_wakes_the_waiter_at_once():
    rig = Rig(workers=1)
    session_id, upstream = await running_session(rig)
    waiting = asyncio.ensure_future(
        until_a_request_ends(rig.router, [session_id], time.monotonic() + 60)
    )
    await rig.settle()
    assert not waiting.done() and rig.router.watchers.keys() == {session_id}
    upstream.send(OK)
    await asyncio.wait_for(waiting, 1)  # woken, long before the deadline
    assert rig.router.active == {} and rig.router.watchers == {}


async def test_a_request_of_another_session_does_not_wake_it():
    rig = Rig(workers=1)
    watched, _ = await running_session(rig)
    other, other_upstream = await running_session(rig)
    waiting = asyncio.ensure_future(
        until_a_request_ends(rig.router, [watched], time.monotonic() + 60)
    )
    await rig.settle()
    other_upstream.send(OK)
    await rig.settle()
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert rig.router.watchers == {}  # a cancelled wait leaves nothing behind


async def test_nothing_ending_by_the_deadline_returns_then():
    rig = Rig(workers=1)
    session_id, _ = await running_session(rig)
    await until_a_request_ends(rig.router, [session_id], time.monotonic())
    assert rig.router.active == {session_id: 1} and rig.router.watchers == {}


async def test_two_waiters_on_one_session_are_both_woken():
    rig = Rig(workers=1)
    session_id, upstream = await running_session(rig)
    deadline = time.monotonic() + 60
    waits = [
        asyncio.ensure_future(until_a_request_ends(rig.router, [session_id, "idle"], deadline))
        for _ in range(2)
    ]
    await rig.settle()
    assert len(rig.router.watchers[session_id]) == 2
    upstream.send(OK)
    await asyncio.wait_for(asyncio.gather(*waits), 1)
    assert rig.router.watchers == {}


async def test_the_end_of_any_request_of_a_watched_worker_wakes_the_waiter():
    """A decommission waits on its worker (`worker_watch`), not on sessions: the end of
    any request of that worker wakes it; another worker's request does not."""
    rig = Rig(workers=2)
    owner0, owner1 = rig.worker(0).owner, rig.worker(1).owner
    head = b"GET /x HTTP/1.1\r\nHost: t\r\nx-ng-session-owner: %s\r\n\r\n"
    rig.client().send(head % owner1.encode())
    other = await rig.upstream()
    rig.client().send(head % owner0.encode())
    mine = await rig.upstream()
    waiting = asyncio.ensure_future(
        until_a_request_ends(rig.router, [worker_watch(owner0)], time.monotonic() + 60)
    )
    await rig.settle()
    other.send(OK)
    await rig.settle()
    assert not waiting.done()
    mine.send(OK)
    await asyncio.wait_for(waiting, 1)
    assert rig.router.watchers == {}
