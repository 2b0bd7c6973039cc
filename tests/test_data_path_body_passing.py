"""Large Content-Length bodies go to the worker as views of the shared read buffer
(client_connection, read_buffer): the worker gets exactly the bytes a parser-fed body
gives, the next request is parsed after it, and a view a transport keeps is never
overwritten by a later read."""

from __future__ import annotations

import pytest

from gym_proxy.proxy.data_path import read_buffer
from gym_proxy.proxy.data_path.client_connection import (
    DISCARDING,
    LINGERING,
    PASS_BODY_AFTER,
    TUNNEL,
)
from tests.data_path_rig import SWITCH, UPGRADE, RecordingTransport, Rig

pytestmark = pytest.mark.fast

GET = b"GET /after HTTP/1.1\r\nHost: t\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def post(body: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: t\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def body_of(size: int, seed: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


async def _warm(rig: Rig):
    """A first exchange, so the next request finds its worker connection attached (its
    body then goes on as views, not into the exchange's copy-keeping buffer)."""
    client = rig.client()
    client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(OK)
    return client, upstream


async def _answered_with_the_get_behind(rig: Rig, client, upstream, body: bytes) -> None:
    """The worker answers the POST and the GET behind it: both reached it intact."""
    upstream.send(OK)
    await rig.settle()
    upstream.send(OK)
    requests = upstream.requests()
    assert requests[1][3] == body and requests[2][1] == b"/after"
    assert [r[0] for r in client.responses()] == [200, 200, 200]


async def test_a_passed_body_and_the_request_behind_it_arrive_intact():
    rig = Rig()
    client, upstream = await _warm(rig)
    body = body_of(4 * PASS_BODY_AFTER, 1)
    client.send(post(body) + GET)
    upstream.send(OK)
    await rig.settle()
    upstream.send(OK)
    requests = upstream.requests()
    assert [(r[0], r[1]) for r in requests] == [
        (b"GET", b"/"),
        (b"POST", b"/x"),
        (b"GET", b"/after"),
    ]
    assert requests[1][3] == body
    assert [r[0] for r in client.responses()] == [200, 200, 200]


async def test_a_passed_body_may_span_reads():
    rig = Rig()
    client, upstream = await _warm(rig)
    body = body_of(6 * PASS_BODY_AFTER, 2)
    whole = post(body) + GET
    for at in range(0, len(whole), 3 * PASS_BODY_AFTER - 5):
        client.send(whole[at : at + 3 * PASS_BODY_AFTER - 5])
    await _answered_with_the_get_behind(rig, client, upstream, body)


class _KeepingTransport(RecordingTransport):
    """A worker socket that did not take a write at once: it keeps the buffers."""

    def __init__(self, protocol) -> None:
        super().__init__(protocol)
        self.kept: list = []

    def write(self, data) -> None:
        self.kept.append(data)
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return sum(len(part) for part in self.kept)


async def test_a_view_a_transport_keeps_is_not_overwritten_by_later_reads():
    rig = Rig()
    client, upstream = await _warm(rig)
    keeping = _KeepingTransport(upstream.protocol)
    upstream.protocol.transport = keeping
    upstream.protocol.outbox.transport = keeping
    lent = read_buffer.READ.lent
    body = body_of(4 * PASS_BODY_AFTER, 3)
    client.send(post(body))
    assert read_buffer.READ.lent > lent  # the kept view's buffer was given up
    other = rig.client()  # a later read, into the buffer now in use, overwrites nothing
    other.send(post(body_of(4 * PASS_BODY_AFTER, 4)))
    assert b"".join(bytes(part) for part in keeping.kept).endswith(body)


async def test_a_passed_body_the_worker_answered_early_is_dropped_then_the_connection_closes():
    rig = Rig()
    client, upstream = await _warm(rig)
    body = body_of(8 * PASS_BODY_AFTER, 5)
    whole = post(body) + GET
    client.send(whole[: 2 * PASS_BODY_AFTER])  # the head and a quarter of the body
    upstream.send(b"HTTP/1.1 413 Too Large\r\ncontent-length: 0\r\n\r\n")
    assert client.protocol.phase == DISCARDING and client.transport.reading
    sent = len(upstream.transport.data)
    client.send(whole[2 * PASS_BODY_AFTER :])  # the rest, and a request never served
    assert client.protocol.phase == LINGERING and client.transport.eof
    assert [r[0] for r in client.responses()] == [200, 413]
    assert len(rig.upstreams) == 1 and len(upstream.transport.data) == sent


async def test_an_upgrade_in_a_long_read_holds_everything_behind_its_head():
    rig = Rig()
    client = rig.client()
    frames = body_of(2 * PASS_BODY_AFTER, 6)
    client.send(UPGRADE + frames)  # one read, longer than PASS_BODY_AFTER
    upstream = await rig.upstream()
    [(_, url, _, _), (marker, held, _, _)] = upstream.requests()
    assert (url, marker, held) == (b"/ws", b"UPGRADED", b"")  # held until the switch
    upstream.send(SWITCH)
    assert client.protocol.phase == TUNNEL
    assert bytes(upstream.transport.data).endswith(b"\r\n\r\n" + frames)


async def test_input_handed_as_bytes_is_read_as_reads_are():
    # uvloop looks data_received up on every connection; whoever calls it gets a read.
    rig = Rig()
    client, upstream = await _warm(rig)
    body = body_of(2 * read_buffer.SIZE, 7)  # more than one buffer holds
    client.protocol.data_received(post(body) + GET)
    await _answered_with_the_get_behind(rig, client, upstream, body)
