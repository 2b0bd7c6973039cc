"""The data path's part of a session move, driven in process: a request of a moving
session waits unrouted (its body buffered), and starts again, routed by the tables as
they are then; requests in flight are counted per session."""

from __future__ import annotations

import pytest

from gym_proxy.proxy.data_path.exchange import DONE, HELD, start_held
from tests.data_path_rig import Rig

pytestmark = pytest.mark.fast

TOKEN = b"x-nemo-gym-session-token"


def post(token: bytes, body: bytes, path: bytes = b"/x") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\n%s: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (path, TOKEN, token, len(body)) + body


async def test_a_held_request_waits_then_goes_where_the_table_says():
    rig = Rig(workers=2)
    token = rig.codec.sign("sess1", "owner0").encode()
    rig.router.holding["sess1"] = []
    client = rig.client()
    client.send(post(token, b"hello")[:-2])  # the body arrives in two pieces
    await rig.settle()
    [held] = rig.router.holding["sess1"]
    assert rig.upstreams == [] and held.state == HELD
    client.send(b"lo")
    rig.router.sessions["sess1"] = "owner1"  # the move placed it on worker 1
    start_held(rig.router, ["sess1"])
    upstream = await rig.upstream()
    assert "sess1" not in rig.router.holding
    [(method, path, headers, body)] = upstream.requests()
    assert (path, body, headers[b"x-ng-session-id"]) == (b"/x", b"hello", b"sess1")
    assert rig.worker(1).in_flight == 1 and rig.worker(0).in_flight == 0
    assert rig.router.active == {"sess1": 1}
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert [r[0] for r in client.responses()] == [200]
    assert rig.router.active == {} and held.state == DONE  # counted while routed, no longer


async def test_other_sessions_pass_and_a_held_request_whose_client_left_is_skipped():
    rig = Rig(workers=1)
    held, free = (rig.codec.sign(s, "owner0").encode() for s in ("held", "free"))
    rig.router.holding["held"] = []
    gone = rig.client()
    gone.send(post(held, b"x"))
    other = rig.client()
    other.send(post(free, b"y"))
    upstream = await rig.upstream()
    assert [r[3] for r in upstream.requests()] == [b"y"]  # another session is not held
    gone.hang_up()
    start_held(rig.router, ["held"])
    await rig.settle()
    assert [r[3] for r in upstream.requests()] == [b"y"] and len(rig.upstreams) == 1
    assert rig.router.active == {"free": 1}


async def test_a_held_request_body_is_under_flow_control():
    """A held request keeps what came of its body and reads no more until it is sent on
    (as in CONNECTING): the client waits, the proxy's memory does not grow with it."""
    rig = Rig(workers=1)
    token = rig.codec.sign("sess1", "owner0").encode()
    rig.router.holding["sess1"] = []
    client = rig.client()
    head = b"POST /x HTTP/1.1\r\nHost: t\r\n%s: %s\r\ncontent-length: 6\r\n\r\n" % (TOKEN, token)
    client.send(head + b"abc")
    await rig.settle()
    assert not client.transport.reading and rig.upstreams == []
    client.send(b"def")  # what the kernel already had: kept, still paused
    start_held(rig.router, ["sess1"])
    upstream = await rig.upstream()
    assert client.transport.reading  # sent on: the rest may come
    [(_, _, _, body)] = upstream.requests()
    assert body == b"abcdef"
