"""The forwarding state machine, driven in process (milliseconds per case).

Real `ClientConnection`, `Exchange` and `UpstreamConnection` objects; the rig's
recording transports stand where sockets would, and the test plays client and worker.
What needs real processes (workers, sockets, timing of the kernel) is tested elsewhere.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gym_proxy.proxy.data_path.client_connection import (
    CLOSED,
    DISCARDING,
    LINGERING,
    READING,
    TUNNEL,
)
from gym_proxy.proxy.data_path.exchange import DONE
from tests.data_path_rig import (
    SWITCH,
    TUNNEL_BYTES,
    UPGRADE,
    Rig,
    parse_requests,
    parse_responses,
)

pytestmark = pytest.mark.fast

GET = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def post(body: bytes, extra: bytes = b"", path: bytes = b"/x") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path,
        len(body),
        extra,
        body,
    )


def error_code(body: bytes) -> str:
    return orjson.loads(body)["error"]["code"]


# ---- keep-alive and pipelining -----------------------------------------------------
async def test_keep_alive_reuses_one_worker_connection():
    rig = Rig()
    client = rig.client()
    for _ in range(3):
        client.send(GET)
        upstream = await rig.upstream()
        upstream.send(OK)
    assert len(rig.upstreams) == 1
    assert [r[0] for r in client.responses()] == [200, 200, 200]
    assert len(upstream.requests()) == 3
    assert client.protocol.phase == READING and not client.transport.closing


async def test_pipelined_requests_go_one_at_a_time_and_answer_in_order():
    rig = Rig()
    client = rig.client()
    client.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    assert [r[1] for r in upstream.requests()] == [b"/a"]  # /b waits its turn
    assert not client.transport.reading  # and the client is not read meanwhile
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nA")
    assert [r[1] for r in upstream.requests()] == [b"/a", b"/b"]
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nB")
    assert [r[2] for r in client.responses()] == [b"A", b"B"]
    assert client.transport.reading


async def test_a_broken_request_behind_a_good_one_is_answered_after_it():
    rig = Rig()
    client = rig.client()
    client.send(GET + b"NOT HTTP\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(OK)
    responses = client.responses()
    assert [r[0] for r in responses] == [200, 400]
    assert error_code(responses[1][2]) == "bad_request"
    assert client.protocol.phase == LINGERING and client.transport.eof
    assert len(upstream.requests()) == 1


# ---- bodies ----------------------------------------------------------------------
async def test_chunked_request_is_rechunked_with_the_proxys_framing():
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    client.send(b"5\r\nhello\r\n")
    upstream = await rig.upstream()
    client.send(b"6\r\n world\r\n0\r\n\r\n")
    [(method, _, headers, body)] = upstream.requests()
    assert method == b"POST" and body == b"hello world"
    assert headers[b"transfer-encoding"] == b"chunked" and b"content-length" not in headers
    upstream.send(OK)
    assert client.responses()[0][0] == 200


async def test_chunked_response_and_a_response_without_length_reach_the_client_chunked():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
    upstream.send(b"0\r\n\r\n")
    client.send(GET)
    upstream.send(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil-eof")
    upstream.hang_up()
    [(s1, h1, b1), (s2, h2, b2)] = client.responses()
    assert (b1, b2) == (b"abc", b"until-eof")
    assert h1[b"transfer-encoding"] == h2[b"transfer-encoding"] == b"chunked"
    assert not client.transport.closing  # the worker's close is not the client's


async def test_http10_client_gets_a_close_delimited_body():
    rig = Rig()
    client = rig.client()
    client.send(b"GET /x HTTP/1.0\r\n\r\n")
    upstream = await rig.upstream()
    [(_, _, headers, _)] = upstream.requests()
    assert headers[b"host"] == b"gym-proxy"  # HTTP/1.1 to the worker needs one
    upstream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    data = bytes(client.transport.data)
    assert b"transfer-encoding" not in data.lower() and data.endswith(b"\r\n\r\nabc")
    assert client.transport.closing


async def test_expect_100_continue_is_answered_by_the_proxy():
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\ncontent-length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert bytes(client.transport.data) == b"HTTP/1.1 100 Continue\r\n\r\n"
    client.transport.take()
    client.send(b"data")
    upstream = await rig.upstream()
    [(_, _, headers, body)] = upstream.requests()
    assert body == b"data" and b"expect" not in headers
    upstream.send(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)  # the worker's own is dropped
    assert [r[0] for r in client.responses()] == [200]


async def test_interim_responses_are_dropped_and_the_final_one_relayed():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
    upstream.send(OK)
    assert [r[0] for r in client.responses()] == [200]
    client.send(GET)
    upstream.send(OK)
    assert len(rig.upstreams) == 1


@pytest.mark.parametrize("status", [204, 304])
async def test_bodiless_statuses_get_no_framing_and_keep_the_connection(status):
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 %d X\r\netag: 1\r\n\r\n" % status)
    client.send(GET)
    upstream.send(OK)
    head = bytes(client.transport.data).split(b"\r\n\r\n")[0].lower()
    assert b"transfer-encoding" not in head and b"content-length" not in head
    assert [r[0] for r in client.responses()] == [status, 200]
    assert len(rig.upstreams) == 1


# ---- HEAD ------------------------------------------------------------------------
async def test_head_response_ends_at_its_head_and_the_connection_is_not_reused():
    rig = Rig()
    client = rig.client()
    client.send(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
    assert upstream.transport.closing  # a HEAD's connection is never reused
    client.send(GET)
    (await rig.upstream()).send(OK)
    [(s1, h1, b1), (s2, _, b2)] = client.responses(head_requests=1)
    assert (s1, h1[b"content-length"], b1) == (200, b"10", b"")
    assert (s2, b2) == (200, b"ok")
    assert len(rig.upstreams) == 2


async def test_a_head_body_sent_in_a_later_read_never_answers_the_next_request():
    # aiohttp sends a StreamResponse's body to a HEAD: after the head, in its own write.
    rig = Rig()
    client = rig.client()
    client.send(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
    first = await rig.upstream()
    first.send(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    client.send(GET)
    second = await rig.upstream()
    first.send(b"junk")  # late: the GET is on another connection
    second.send(OK)
    assert [r[0] for r in client.responses(head_requests=1)] == [200, 200]
    assert second is not first and first.transport.closing


async def test_head_response_followed_by_bytes_is_not_reused():
    rig = Rig()
    client = rig.client()
    client.send(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\njunk")
    assert upstream.transport.closing  # a worker that sent a HEAD body is not trusted
    client.send(GET)
    (await rig.upstream()).send(OK)
    assert len(rig.upstreams) == 2
    assert [r[0] for r in client.responses(head_requests=1)] == [200, 200]


async def test_head_response_without_length_ends_at_its_head():
    rig = Rig()
    client = rig.client()
    client.send(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    client.send(GET)
    (await rig.upstream()).send(OK)
    assert len(rig.upstreams) == 2
    assert [r[0] for r in client.responses(head_requests=1)] == [200, 200]


# ---- closing, in every direction ---------------------------------------------------
async def test_client_connection_close_is_honoured_after_the_response():
    rig = Rig()
    client = rig.client()
    client.send(b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(OK)
    [(_, headers, _)] = client.responses()
    assert headers[b"connection"] == b"close" and client.transport.closing
    assert not upstream.transport.closing  # the worker connection goes back to the pool
    assert rig.worker().pool.idle == [upstream.protocol]


async def test_an_idle_worker_connection_is_closed_after_the_pool_idle_time_only():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(OK)
    pool = rig.worker().pool
    idle_since = upstream.protocol.last_active  # its last read, by the coarse clock
    pool.close_idle(idle_since)  # not idle for longer than that
    assert pool.idle == [upstream.protocol] and not upstream.transport.closing
    pool.close_idle(idle_since + 0.001)
    assert upstream.transport.closing
    await rig.settle()
    assert pool.idle == [] and not upstream.protocol.pooled  # forgotten once it closed
    client.send(GET)  # and never handed out again
    (await rig.upstream()).send(OK)
    assert len(rig.upstreams) == 2 and [r[0] for r in client.responses()] == [200, 200]


async def test_worker_connection_close_keeps_the_client_open():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
    assert upstream.transport.closing and not client.transport.closing
    assert b"connection" not in client.responses()[0][1]
    client.send(GET)
    (await rig.upstream()).send(OK)
    assert len(rig.upstreams) == 2


async def test_client_hanging_up_mid_request_drops_the_worker_connection():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhal")
    client.hang_up()
    assert upstream.transport.aborted  # the app sees its client go
    assert rig.worker().in_flight == 0 and rig.worker().pool.idle == []


async def test_worker_hanging_up_mid_body_cuts_the_client():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhal")
    upstream.hang_up()
    assert client.transport.aborted  # a truncated response must look truncated
    assert rig.worker().in_flight == 0


async def test_worker_hanging_up_before_answering_is_502_and_the_client_stays():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.hang_up(ConnectionResetError("reset"))
    [(status, _, body)] = client.responses()
    assert status == 502 and error_code(body) == "upstream_connection_lost"
    assert not client.transport.closing
    client.send(GET)
    (await rig.upstream()).send(OK)
    assert [r[0] for r in client.responses()] == [502, 200]


async def test_worker_answering_before_the_body_ended_discards_the_rest_then_closes():
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\ncontent-length: 100\r\n\r\n" + b"a" * 10)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 413 Too Large\r\ncontent-length: 0\r\n\r\n")
    [(status, headers, _)] = client.responses()
    assert status == 413 and headers[b"connection"] == b"close"
    assert client.protocol.phase == DISCARDING and client.transport.reading
    client.send(b"a" * 90 + GET)  # the rest of the body, and a request never served
    assert client.protocol.phase == LINGERING and client.transport.eof
    assert len(rig.upstreams) == 1 and len(client.responses()) == 1


async def test_worker_hanging_up_while_the_body_streams_is_502_after_the_body():
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n")
    upstream = await rig.upstream()
    upstream.hang_up(BrokenPipeError("worker went away"))
    assert client.responses() == []  # answered once the body is read, so the
    client.send(b"0\r\n\r\n")  # connection stays in step
    [(status, _, body)] = client.responses()
    assert status == 502 and error_code(body) == "upstream_connection_lost"
    assert client.protocol.phase == READING


async def test_a_client_that_half_closes_is_gone():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    await rig.upstream()
    assert client.protocol.eof_received() is False  # asyncio then closes the transport


async def test_a_late_response_after_the_client_left_goes_nowhere():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    client.hang_up()
    upstream.send(OK)  # the aborted worker connection may still deliver a read
    assert bytes(client.transport.data) == b""


# ---- back-pressure ---------------------------------------------------------------
async def test_a_slow_client_pauses_the_worker_and_a_slow_worker_pauses_the_client():
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\ncontent-length: 10\r\n\r\nab")
    upstream = await rig.upstream()
    upstream.protocol.pause_writing()  # the worker's socket buffer is full
    assert not client.transport.reading
    upstream.protocol.resume_writing()
    assert client.transport.reading
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
    client.protocol.pause_writing()  # the client's socket buffer is full
    assert not upstream.transport.reading
    client.protocol.resume_writing()
    assert upstream.transport.reading


async def test_body_arriving_before_the_worker_connection_is_buffered_once():
    rig = Rig()
    rig.connect_gate = gate = asyncio.Event()
    client = rig.client()
    client.send(post(b"0123456789"))
    await rig.settle()
    assert not rig.upstreams and not client.transport.reading  # body held, reading paused
    gate.set()
    upstream = await rig.upstream()
    assert upstream.transport.writes == 1  # head and buffered body in one write
    assert upstream.requests()[0][3] == b"0123456789"
    assert client.transport.reading


# ---- worker failures at every point -------------------------------------------------
async def test_worker_refusing_connections_is_502():
    rig = Rig()
    rig.connect_failure = lambda: ConnectionRefusedError("refused")
    client = rig.client()
    client.send(post(b"body"))
    await rig.settle()
    [(status, _, body)] = client.responses()
    assert status == 502 and error_code(body) == "upstream_connection_lost"
    assert rig.worker().in_flight == 0


async def test_an_invalid_worker_response_is_502_and_the_connection_dropped():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 abc\r\n\r\n")
    [(status, _, body)] = client.responses()
    assert status == 502 and error_code(body) == "upstream_protocol_error"
    assert upstream.transport.closing


async def test_an_unrequested_101_is_502():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n")
    [(status, _, body)] = client.responses()
    assert status == 502 and error_code(body) == "upstream_protocol_error"


async def test_a_silent_worker_is_504_and_its_late_answer_goes_nowhere():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    client.protocol.pipeline[0].timed_out()  # what the sweep does after --upstream-timeout
    [(status, _, body)] = client.responses()
    assert status == 504 and error_code(body) == "upstream_timeout"
    assert upstream.transport.closing
    upstream.send(OK)
    assert len(client.responses()) == 1


async def test_a_worker_gone_mid_request_is_410():
    rig = Rig(workers=2)
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    gone = client.protocol.pipeline[0].worker
    assert gone is not None
    rig.router.remove_worker(gone.owner)
    upstream.hang_up()
    [(status, _, body)] = client.responses()
    assert status == 410 and error_code(body) == "session_owner_gone"


async def test_failure_after_the_response_started_cuts_the_client():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nZZ")
    assert client.transport.aborted and upstream.transport.closing


async def test_an_error_decided_before_the_body_waits_for_it_then_answers():
    rig = Rig()
    client = rig.client()
    head = post(b"abcdef", b"x-ng-session-owner: bad owner\r\n")
    client.send(head[:-4])
    assert client.responses() == []  # the answer waits until the body is read
    client.send(b"cdef")
    [(status, _, body)] = client.responses()
    assert status == 400 and error_code(body) == "invalid_session_token"
    assert not rig.upstreams and client.protocol.phase == READING


# ---- smuggling shapes -------------------------------------------------------------
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(SMUGGLED),
        b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n" % len(SMUGGLED),
        b"Content-Length: %d\r\nContent-Length: 0\r\n" % len(SMUGGLED),
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        b"Transfer-Encoding: xchunked\r\n",
        b"Transfer-Encoding : chunked\r\n",
        b"Transfer-Encoding:\x0bchunked\r\n",
        b"Content-Length: +%d\r\n" % len(SMUGGLED),
        b"Content-Length: %d, %d\r\n" % (len(SMUGGLED), len(SMUGGLED)),
    ],
)
async def test_ambiguous_framing_is_400_and_nothing_reaches_a_worker(head):
    rig = Rig()
    client = rig.client()
    client.send(b"POST /x HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n" + SMUGGLED)
    await rig.settle()
    [(status, _, body)] = client.responses()
    assert status == 400 and error_code(body) == "bad_request"
    assert all(not u.requests() for u in rig.upstreams)
    assert client.protocol.phase == LINGERING


async def test_connection_cannot_remove_framing_so_the_worker_sees_one_request():
    rig = Rig()
    client = rig.client()
    client.send(post(SMUGGLED, b"Connection: content-length, host\r\n"))
    upstream = await rig.upstream()
    [(_, url, headers, body)] = upstream.requests()
    assert (url, body) == (b"/x", SMUGGLED)
    assert headers[b"content-length"] == b"%d" % len(SMUGGLED) and headers[b"host"] == b"t"


async def test_identity_headers_from_a_client_never_reach_the_worker():
    rig = Rig()
    client = rig.client()
    client.send(
        b"GET /x HTTP/1.1\r\nHost: t\r\nx-ng-session-id: forged\r\nx-ng-episode-key: k\r\n\r\n"
    )
    upstream = await rig.upstream()
    [(_, _, headers, _)] = upstream.requests()
    assert headers[b"x-ng-session-id"] != b"forged" and b"x-ng-episode-key" not in headers


# ---- writes are coalesced ------------------------------------------------------------
async def test_one_read_makes_one_write_each_way():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    client.send(post(b"x" * 100))  # head and body in one read: one write to the worker
    writes = upstream.transport.writes
    upstream.send(OK)  # (the first request's answer)
    assert upstream.transport.writes == writes + 1
    before = client.transport.writes
    upstream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert client.transport.writes == before + 1  # head, chunk and last chunk together


# ---- upgrades and tunnels ---------------------------------------------------------


async def test_websocket_upgrade_becomes_a_tunnel_both_ways():
    rig = Rig()
    client = rig.client()
    client.send(UPGRADE + b"early-frame")  # a client may send right behind its head
    upstream = await rig.upstream()
    [(method, url, headers, _), (marker, held, _, _)] = upstream.requests()
    assert (url, headers[b"upgrade"], headers[b"connection"]) == (b"/ws", b"websocket", b"upgrade")
    assert marker == b"UPGRADED" and held == b""  # held until the worker switches
    assert not client.transport.reading
    upstream.send(SWITCH + b"server-frame")
    [switched, (after, _, rest)] = parse_responses(bytes(client.transport.data))
    assert switched[0] == 101 and switched[1][b"upgrade"] == b"websocket"
    assert (after, rest) == (TUNNEL_BYTES, b"server-frame")
    assert bytes(upstream.transport.data).endswith(b"\r\n\r\nearly-frame")
    assert client.protocol.phase == TUNNEL and client.transport.reading
    client.send(b"\x81\x05hello")
    upstream.send(b"\x81\x02hi")
    assert bytes(upstream.transport.data).endswith(b"early-frame\x81\x05hello")
    assert bytes(client.transport.data).endswith(b"server-frame\x81\x02hi")
    upstream.hang_up()  # the worker ends the tunnel: so does the client side
    assert client.transport.closing
    await rig.settle()
    assert rig.worker().in_flight == 0


async def test_tunnel_back_pressure_works_both_ways():
    rig = Rig()
    client = rig.client()
    client.send(UPGRADE)
    upstream = await rig.upstream()
    upstream.send(SWITCH)
    upstream.protocol.pause_writing()
    assert not client.transport.reading
    upstream.protocol.resume_writing()
    client.protocol.pause_writing()
    assert not upstream.transport.reading
    client.protocol.resume_writing()
    assert upstream.transport.reading and client.transport.reading


async def test_client_closing_a_tunnel_closes_the_worker_side():
    rig = Rig()
    client = rig.client()
    client.send(UPGRADE)
    upstream = await rig.upstream()
    upstream.send(SWITCH)
    client.hang_up()
    assert upstream.transport.closing and rig.worker().in_flight == 0


async def test_tunnel_idle_timeout_closes_both_sides():
    rig = Rig()
    client = rig.client()
    client.send(UPGRADE)
    upstream = await rig.upstream()
    upstream.send(SWITCH)
    client.protocol.tunnel_timed_out()  # what the sweep does after --tunnel-idle-timeout
    assert client.transport.closing and upstream.transport.closing


async def test_an_upgrade_the_worker_declines_is_answered_then_closed():
    rig = Rig()
    client = rig.client()
    client.send(UPGRADE + b"ignored")
    upstream = await rig.upstream()
    upstream.send(OK)
    [(status, headers, _)] = client.responses()
    assert status == 200 and headers[b"connection"] == b"close"
    assert client.protocol.phase in (LINGERING, CLOSED)
    assert not bytes(upstream.transport.data).endswith(b"ignored")


async def test_a_declined_upgrade_never_returns_its_worker_connection_to_the_pool():
    # The worker may have stopped parsing HTTP after the upgrade head (aiohttp does),
    # even though it answered a keep-alive 200: the next request must not go there.
    rig = Rig()
    body = b"POST /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    upgrade_post = (
        b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    client = rig.client()
    client.send(upgrade_post)
    upstream = await rig.upstream()
    upstream.send(OK)
    assert upstream.transport.closing
    other = rig.client()
    other.send(GET)
    (await rig.upstream()).send(OK)
    assert len(rig.upstreams) == 2 and [r[0] for r in other.responses()] == [200]


async def test_bytes_after_a_response_in_the_same_read_spoil_the_connection():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(OK + b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nstale!")
    assert upstream.transport.closing  # llhttp would have parsed them as the next answer
    client.send(GET)
    (await rig.upstream()).send(OK)
    assert [(r[0], r[2]) for r in client.responses()] == [(200, b"ok"), (200, b"ok")]
    assert len(rig.upstreams) == 2


async def test_an_interim_response_before_the_final_one_keeps_the_connection():
    rig = Rig()
    client = rig.client()
    client.send(GET)
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    assert not upstream.transport.closing
    client.send(GET)
    upstream.send(OK)
    assert len(rig.upstreams) == 1


async def test_connect_is_refused_with_501():
    rig = Rig()
    client = rig.client()
    client.send(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\nxx")
    await rig.settle()
    [(status, _, body)] = client.responses()
    assert status == 501 and error_code(body) == "upgrade_not_supported"
    assert not rig.upstreams and client.protocol.phase == LINGERING


async def test_upgrade_behind_a_pipelined_request_waits_its_turn():
    rig = Rig()
    client = rig.client()
    client.send(GET + UPGRADE)
    upstream = await rig.upstream()
    assert [r[1] for r in upstream.requests()] == [b"/x"]
    upstream.send(OK)
    assert [r[1] for r in upstream.requests()][:2] == [b"/x", b"/ws"]
    upstream.send(SWITCH)
    assert client.protocol.phase == TUNNEL
    exchange = client.protocol.pipeline[0]
    client.protocol.tunnel_timed_out()
    assert exchange.state == DONE


async def test_the_proxys_requests_parse_as_exactly_what_the_client_sent():
    rig = Rig()
    client = rig.client()
    client.send(post(b'{"a": 1}', b"X-Custom: v\r\n", b"/echo?q=1"))
    upstream = await rig.upstream()
    [(method, url, headers, body)] = parse_requests(bytes(upstream.transport.data))
    assert (method, url, body, headers[b"x-custom"]) == (b"POST", b"/echo?q=1", b'{"a": 1}', b"v")
    assert headers[b"x-ng-session-new"] == b"1"


async def test_a_head_is_timed_from_its_start_by_the_exact_clock_not_the_coarse_one():
    """The coarse clock (`ProxyState.now`) lags up to a sweep interval behind; stamped
    with it, a head that began just now looked a second old, and a 1 s --header-timeout
    answered 408 at once (a CI failure). A head's start is read from the exact clock."""
    exact = [100.0]
    rig = Rig(workers=1, now=90.0, clock=lambda: exact[0])
    client = rig.client()
    assert client.protocol.head_since == 100.0  # the connection's start: its first head
    client.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
    upstream = await rig.upstream()
    upstream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    assert client.protocol.head_since is None  # between requests: the keep-alive timeout
    exact[0] = 130.0
    client.send(b"GET /b HTTP/1.1\r\n")  # the next head begins, and stays unfinished
    assert client.protocol.head_since == 130.0
