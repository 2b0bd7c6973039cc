"""A pool with a limit (the control app's): connections never exceed it, and calls over
it wait in line for one, driven in process with the data-path rig."""

from __future__ import annotations

import asyncio

import pytest

from gym_proxy.proxy.data_path.routing import WorkerRoute
from gym_proxy.proxy.data_path.upstream import UpstreamPool
from tests.data_path_rig import Rig

pytestmark = pytest.mark.fast

CALL = b"GET /ng-control/v1/checkpoint/status HTTP/1.1\r\nHost: t\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def limited_rig(limit: int) -> tuple[Rig, UpstreamPool]:
    rig = Rig()
    pool = UpstreamPool("ctl", connect=rig._connect, limit=limit)
    rig.state.control = WorkerRoute("control", -1, "/rig/control.sock", pool=pool)
    return rig, pool


async def test_calls_over_the_limit_wait_for_a_released_connection():
    rig, pool = limited_rig(2)
    clients = [rig.client() for _ in range(3)]
    for client in clients:
        client.send(CALL)
    await rig.settle()
    assert len(rig.upstreams) == 2 and len(pool.waiting) == 1
    rig.upstreams[0].send(OK)
    await rig.settle()
    assert len(rig.upstreams) == 2  # the third call went on the released connection
    assert len(rig.upstreams[0].requests()) == 2
    rig.upstreams[0].send(OK)
    rig.upstreams[1].send(OK)
    assert [[r[0] for r in c.responses()] for c in clients] == [[200]] * 3
    assert pool.open == 2 and not pool.waiting


async def test_a_closed_connection_makes_room_and_gone_clients_leave_the_line():
    rig, pool = limited_rig(1)
    first, gone, waiting = rig.client(), rig.client(), rig.client()
    for client in (first, gone, waiting):
        client.send(CALL)
    await rig.settle()
    assert len(rig.upstreams) == 1 and len(pool.waiting) == 2
    gone.hang_up()
    rig.upstreams[0].send(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
    await rig.settle()
    assert len(rig.upstreams) == 2 and pool.open == 1  # a new one, for the live caller
    assert len(rig.upstreams[1].requests()) == 1
    rig.upstreams[1].send(OK)
    assert [r[0] for r in waiting.responses()] == [200]
    assert gone.responses() == []


async def test_a_failed_connect_makes_room_and_closing_the_pool_answers_the_line():
    rig, pool = limited_rig(1)
    rig.connect_failure = lambda: ConnectionRefusedError("no control app")
    failed, waiting = rig.client(), rig.client()
    failed.send(CALL)
    waiting.send(CALL)
    await rig.settle()
    assert [r[0] for r in failed.responses()] == [502]
    assert [r[0] for r in waiting.responses()] == [502]  # its own connect, refused too
    assert pool.open == 0
    rig.connect_failure = None
    rig.connect_gate = gate = asyncio.Event()
    held, queued = rig.client(), rig.client()
    held.send(CALL)
    queued.send(CALL)
    await rig.settle()
    assert len(pool.waiting) == 1
    pool.close()
    gate.set()
    await rig.settle()
    assert [r[0] for r in queued.responses()] == [502]
    assert [r[0] for r in held.responses()] == [502]
