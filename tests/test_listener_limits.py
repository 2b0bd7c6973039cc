"""What a client of the `--metrics` listener cannot make the proxy do: take the data
path's descriptors with idle connections, or hold connections open with heads that never
end. Real processes under a low descriptor limit (`ulimit -n 256`)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import orjson

from gym_proxy.coordinator.contract.errors import STATUS
from gym_proxy.proxy.descriptor_budget import (
    CHANNEL_MARGIN,
    CONTROL_CONNECTIONS,
    METRICS_CONNECTIONS,
)
from tests.raw_http import Responses, close, read_responses
from tests.support import CONTROL_TOKEN, ProxyProcess, wait_until, wait_until_sync

NOFILE = 256
FLOOD_PARTIAL = 40  # metrics connections that send half a head
FLOOD_IDLE = 60  # and that send nothing
HEADER_TIMEOUT = 5.0
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: t\r\n"
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def metrics_port(proxy: ProxyProcess) -> int:
    found = wait_until_sync(
        lambda: re.search(r"metrics on http://[^:]+:(\d+)/metrics", proxy.log()),
        10,
        "the metrics address",
    )
    return int(found.group(1))


async def connect(port: int) -> Connection | None:
    """A TCP connection to `port`, or None when the connect itself fails."""
    try:
        return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except (OSError, TimeoutError):
        return None


async def open_many(port: int, count: int, first: bytes = b"") -> list[Connection]:
    """`count` connections at once (each sends `first`); those whose connect failed are
    left out."""
    opened = await asyncio.gather(*(connect(port) for _ in range(count)))
    connections = [c for c in opened if c is not None]
    for _, writer in connections:
        writer.write(first)
    return connections


RESET = b"<reset>"  # what until_closed returns for a connection the peer reset


async def closed_at(reader: asyncio.StreamReader, within: float) -> tuple[bytes, float]:
    """What the peer sent until it closed, and when it closed (monotonic)."""
    received = await until_closed(reader, within)
    return received, time.monotonic()


async def until_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the peer sends until it closes; RESET if it reset the connection (its
    answer, if any, is lost with it)."""
    received = b""
    async with asyncio.timeout(within):
        while True:
            try:
                data = await reader.read(65536)
            except ConnectionError:
                return RESET
            if not data:
                return received
            received += data


async def scrape(port: int) -> bytes | None:
    """One scrape on a new connection: the body of a 200, else None."""
    opened = await connect(port)
    if opened is None:
        return None
    reader, writer = opened
    writer.write(SCRAPE)
    try:
        responses = await read_responses(reader, 1)
    except (ConnectionError, TimeoutError):
        responses = []
    await close(writer)
    if responses and responses[0][0] == 200:
        return responses[0][2]
    return None


def parse_responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    parsed = Responses()
    parsed.parser.feed_data(data)
    return parsed.done


def error_code(received: bytes) -> str | None:
    """The error code of the one answer in `received` (None: nothing was answered)."""
    if not received:
        return None
    [(status, _, body)] = parse_responses(received)
    code = orjson.loads(body)["error"]["code"]
    assert status == STATUS[code]
    return code


def gauge(text: bytes, name: str) -> float:
    found = re.search(rb"^%s (\S+)$" % name.encode(), text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


async def test_idle_metrics_connections_leave_the_data_path_its_cap(start_proxy):
    proxy = start_proxy(
        "--metrics",
        "127.0.0.1:0",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        workers=1,
        nofile=NOFILE,
    )
    port = metrics_port(proxy)
    body = await scrape(port)
    assert body is not None
    cap = int(gauge(body, "gym_proxy_connections_max"))
    assert cap >= 32, cap

    # A flood several times the listener's cap but within its listen backlog (128): a
    # connect past a full backlog completes on the client while the kernel drops it, and
    # is accepted seconds later or never, which would test the kernel, not the proxy.
    started = time.monotonic()
    partial = await open_many(port, FLOOD_PARTIAL, PARTIAL)
    idle = await open_many(port, FLOOD_IDLE)
    opened = [*partial, *idle]
    clients: list[Connection] = []
    closing = [asyncio.ensure_future(closed_at(r, HEADER_TIMEOUT + 10)) for r, _ in opened]
    try:
        assert len(opened) == FLOOD_PARTIAL + FLOOD_IDLE
        assert time.monotonic() - started < HEADER_TIMEOUT / 2, (
            "the flood must outrun the header timeout"
        )
        # Every connection over the cap is refused at once; the cap's worth stay held.
        refused = len(opened) - METRICS_CONNECTIONS
        await wait_until(
            lambda: sum(task.done() for task in closing) >= refused,
            HEADER_TIMEOUT / 2,
            "the flood's refusals",
        )

        # The data path serves its whole cap at once, each request in flight on a worker
        # connection of its own (2 descriptors a client), while the flood holds on.
        clients = await open_many(proxy.port, cap)
        assert len(clients) == cap
        for _, writer in clients:
            writer.write(b"GET /slow?seconds=0.5 HTTP/1.1\r\nHost: t\r\n\r\n")
        answers = await asyncio.gather(*(read_responses(r, 1, within=30) for r, _ in clients))
        assert [a[0][0] if a else None for a in answers] == [200] * cap

        ends = await asyncio.gather(*closing)
        check_flood_ends(ends, started)
    finally:
        for task in closing:
            task.cancel()
        for _, writer in [*opened, *clients]:
            await close(writer)

    after = await wait_until(lambda: scrape(port), 10, "a scrape after the flood")
    assert isinstance(after, bytes)
    assert gauge(after, "gym_proxy_connections_max") == cap


def check_flood_ends(ends: list[tuple[bytes, float]], started: float) -> None:
    """The flood's closes (the first FLOOD_PARTIAL connections sent half a head): those
    over the cap answered 503 at once, the cap's worth held to the header timeout."""
    outcomes = [
        ("reset" if received == RESET else error_code(received), at - started)
        for received, at in ends
    ]
    held = [(code, after) for code, after in outcomes if code in ("request_timeout", None)]
    refused = [(code, after) for code, after in outcomes if (code, after) not in held]
    assert len(held) == METRICS_CONNECTIONS, outcomes
    assert all(after >= HEADER_TIMEOUT - 1 for _, after in held), held
    assert all(after < HEADER_TIMEOUT - 1 for _, after in refused), refused
    # A partial head over the cap may be reset rather than answered: the proxy closes
    # without reading it, and the kernel resets a socket closed with unread bytes.
    assert {code for code, _ in outcomes[:FLOOD_PARTIAL]} <= {
        "too_many_connections",
        "reset",
        "request_timeout",
    }
    assert {code for code, _ in outcomes[FLOOD_PARTIAL:]} <= {"too_many_connections", None}


async def test_metrics_port_serves_scrapes_and_bounds_the_rest(start_proxy):
    proxy = start_proxy(
        "--metrics", "127.0.0.1:0", "--header-timeout", "1", "--keepalive-timeout", "1", workers=1
    )
    port = metrics_port(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(2):  # keep-alive: a scraper's one connection serves every scrape
        writer.write(SCRAPE)
        [(status, headers, body)] = await read_responses(reader, 1)
        assert status == 200 and headers[b"content-type"].startswith(b"text/plain")
        assert b"gym_proxy_connections_max" in body
    started = time.monotonic()
    assert await until_closed(reader, 10) == b""  # idle past the keep-alive timeout
    assert time.monotonic() - started >= 0.5
    await close(writer)

    for request, code in (
        (b"GET /other HTTP/1.1\r\nHost: t\r\n\r\n", "not_found"),
        (b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", "method_not_allowed"),
        (b"GET /metrics HTTP/1.1\r\nHost: t\r\nX: " + b"a" * 9000, "headers_too_large"),
        (b"NOT HTTP\r\n\r\n", "bad_request"),
        (PARTIAL, "request_timeout"),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        [(status, headers, body)] = await read_responses(reader, 1)
        assert (status, orjson.loads(body)["error"]["code"]) == (STATUS[code], code)
        await close(writer)

    # At the cap, one more is answered 503 at once; the idle ones go at the header timeout.
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(METRICS_CONNECTIONS)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(SCRAPE)
    [(status, headers, body)] = await read_responses(reader, 1)
    assert (status, headers[b"retry-after"]) == (503, b"1")
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"
    await close(writer)
    assert await asyncio.gather(*(until_closed(r, 10) for r, _ in idle)) == [b""] * len(idle)
    for _, writer in idle:
        await close(writer)
    assert await wait_until(lambda: scrape(port), 10, "a scrape once the idle ones went")


def unix_connections(path: Path) -> int:
    """Connected sockets accepted on the Unix socket `path` (from /proc/net/unix)."""
    count = 0
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] == str(path) and fields[5] == "03":
            count += 1
    return count


async def peer_closed(reader: asyncio.StreamReader) -> bool:
    """True once the other side closed (without waiting for it)."""
    if reader.at_eof():
        return True
    try:
        return await asyncio.wait_for(reader.read(1), 0.01) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def answers(proxy: ProxyProcess) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
    responses = await read_responses(reader, 1)
    await close(writer)
    return bool(responses) and responses[0][0] == 200


async def test_coordinator_socket_holds_only_workers_and_a_margin(start_proxy):
    proxy = start_proxy(workers=1)
    path = proxy.runtime_dir() / "coordinator.sock"
    strays = [await asyncio.open_unix_connection(str(path)) for _ in range(50)]

    # Over the cap (1 worker + the margin) each new one closed the oldest unregistered.
    async def closed_at_once() -> bool:
        ends = await asyncio.gather(*(peer_closed(r) for r, _ in strays))
        return sum(ends) >= len(strays) - CHANNEL_MARGIN

    await wait_until(closed_at_once, 5, "strays over the cap closed (well before 10 s)")
    assert unix_connections(path) <= 1 + CHANNEL_MARGIN

    # A worker that dies while strays hold the margin still comes back and registers.
    [worker] = proxy.worker_pids()
    os.kill(worker, signal.SIGKILL)
    more = [await asyncio.open_unix_connection(str(path)) for _ in range(CHANNEL_MARGIN)]

    async def served_by_a_new_worker() -> bool:
        pids = proxy.worker_pids()
        return bool(pids) and pids != [worker] and await answers(proxy)

    await wait_until(served_by_a_new_worker, 30, "the replacement worker to serve")
    for _, writer in [*strays, *more]:
        await close(writer)


async def test_control_calls_share_a_few_connections(start_proxy):
    proxy = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    path = proxy.runtime_dir() / "control.sock"
    calls = 60
    clients = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(calls)]
    for _, writer in clients:
        writer.write(
            b"GET /ng-control/v1/checkpoint/status HTTP/1.1\r\nHost: t\r\n"
            b"Authorization: Bearer %s\r\n\r\n" % CONTROL_TOKEN.encode()
        )
    replies = await asyncio.gather(*(read_responses(r, 1, within=30) for r, _ in clients))
    assert [r[0][0] if r else None for r in replies] == [200] * calls
    # The pool keeps its connections (30 s) for the next calls: the peak is still there.
    assert 0 < unix_connections(path) <= CONTROL_CONNECTIONS
    for _, writer in clients:
        await close(writer)
