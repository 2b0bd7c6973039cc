"""What a client cannot make the proxy do: buffer a head without end, hold a connection
open with a head that never completes, take every descriptor, or lose a worker's early
answer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson

from tests.conftest import BOTH_APP_KINDS
from tests.raw_http import close, open_raw, read_responses
from tests.support import wait_until


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def stream_until_answered(proxy, first: bytes, filler: bytes, megabytes: int):
    """Send `first`, then `filler` (1 MiB a write) up to `megabytes`, until the proxy
    answers; return (status, code, MiB sent)."""
    reader, writer = await open_raw(proxy)
    writer.write(first)
    answer = asyncio.ensure_future(read_responses(reader, 1, within=30))
    sent = 0
    try:
        while sent < megabytes and not answer.done():
            writer.write(filler)
            await writer.drain()
            await asyncio.sleep(0)  # let the reader see an answer that came meanwhile
            sent += 1
    except ConnectionError:
        pass  # the proxy closed after answering: expected
    [(status, _, body)] = await answer
    await close(writer)
    return status, orjson.loads(body)["error"]["code"], sent


async def test_never_ending_request_line_and_header_are_cut_off(shared_proxy):
    proxy = shared_proxy(workers=1)
    base = rss_kib(proxy.pid)
    megabyte = b"a" * (1 << 20)
    status, code, sent = await stream_until_answered(proxy, b"GET /", megabyte, 64)
    assert (status, code) == (414, "uri_too_long") and sent < 64
    status, code, sent = await stream_until_answered(
        proxy, b"GET / HTTP/1.1\r\nHost: t\r\nX-Long: ", megabyte, 64
    )
    assert (status, code) == (431, "headers_too_large") and sent < 64
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(10000))
    status, code, sent = await stream_until_answered(proxy, b"GET / HTTP/1.1\r\n" + many, b"", 0)
    assert (status, code) == (431, "headers_too_large")
    assert rss_kib(proxy.pid) - base < 16 * 1024, "the proxy buffered an unbounded head"


async def test_heads_within_the_limits_pass(shared_proxy, http):
    proxy = shared_proxy(workers=1)
    path = "/whoami?" + "q" * 8000
    async with http.get(f"{proxy.url}{path}") as resp:
        assert resp.status == 200
    headers = {f"X-H{i}": "v" * 3000 for i in range(20)}  # 60 KB of headers in all
    async with http.get(f"{proxy.url}/whoami", headers=headers) as resp:
        assert resp.status == 200
        assert (await resp.json())["headers"]["x-h19"] == "v" * 3000


@BOTH_APP_KINDS
async def test_a_worker_takes_every_head_the_proxy_takes(start_proxy, http):
    """What the proxy's limits let through, the worker parses too (aiohttp's own limits
    are 8,190 bytes a header line and 128 headers; websockets' 8,192 and 128): one
    60 KB header, 500 headers, an 8 KB target, and a WebSocket upgrade with all three;
    with larger flags, a 120 KB header."""
    proxy = start_proxy(workers=1)
    one_big = {"X-Big": "v" * 60000}
    many = {f"X-H{i}": "v" for i in range(500)}
    target = "/whoami?" + "q" * 8000
    for path, headers in (("/whoami", one_big), ("/whoami", many), (target, {})):
        async with http.get(f"{proxy.url}{path}", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            seen = (await resp.json())["headers"]
            assert all(seen[name.lower()] == value for name, value in headers.items())
    ws_headers = {**one_big, **{f"X-H{i}": "v" for i in range(200)}}
    async with http.ws_connect(f"{proxy.url}/ws?{'q' * 8000}", headers=ws_headers) as ws:
        await ws.send_str("hello")
        assert (await ws.receive_json(timeout=10))["echo"] == "hello"
    bigger = start_proxy("--limit-request-headers", "131072", workers=1)
    async with http.get(f"{bigger.url}/whoami", headers={"X-Big": "v" * 120000}) as resp:
        assert resp.status == 200, await resp.text()


async def test_limits_are_flags(in_process, http, test_app):
    proxy = await in_process(
        "--limit-request-line", "100", "--limit-request-headers", "1000", workers=1, app=test_app
    )
    async with http.get(f"{proxy.url}/whoami?{'q' * 200}") as resp:
        assert resp.status == 414
        assert resp.headers["Connection"] == "close"
    async with http.get(f"{proxy.url}/whoami", headers={"X-A": "v" * 2000}) as resp:
        assert resp.status == 431
        assert (await resp.json())["error"]["code"] == "headers_too_large"


async def test_slow_heads_time_out(in_process, test_app):
    proxy = await in_process("--header-timeout", "1", workers=1, app=test_app)
    partial = []
    for _ in range(20):
        reader, writer = await open_raw(proxy)
        writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n")
        partial.append((reader, writer))
    silent_reader, silent_writer = await open_raw(proxy)
    slow_reader, slow_writer = await open_raw(proxy)

    async def dribble():  # slowloris: one byte at a time, never finishing
        for byte in b"GET /whoami HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"z" * 200:
            slow_writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    dribbling = asyncio.ensure_future(dribble())
    started = time.monotonic()
    for reader, writer in partial:
        [(status, headers, body)] = await read_responses(reader, 1, within=10)
        assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await close(writer)
    [(status, _, _)] = await read_responses(slow_reader, 1, within=10)
    assert status == 408
    dribbling.cancel()
    # nothing was sent at all: closed without an answer
    assert await asyncio.wait_for(silent_reader.read(), 10) == b""
    assert time.monotonic() - started < 8
    await close(silent_writer)
    await close(slow_writer)


async def test_keep_alive_connection_is_not_a_slow_head(in_process, test_app):
    proxy = await in_process("--header-timeout", "1", workers=1, app=test_app)
    reader, writer = await open_raw(proxy)
    writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
    [(status, _, _)] = await read_responses(reader, 1)
    assert status == 200
    await asyncio.sleep(2.5)  # idle between requests: the keep-alive timeout governs, not this
    writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
    [(status, _, _)] = await read_responses(reader, 1)
    assert status == 200
    await close(writer)


async def test_connection_cap(in_process, test_app):
    proxy = await in_process("--max-connections", "3", workers=1, app=test_app)
    held = []
    for _ in range(3):
        reader, writer = await open_raw(proxy)
        writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
        [(status, _, _)] = await read_responses(reader, 1)
        assert status == 200
        held.append((reader, writer))
    # at the cap, a keep-alive connection idle between requests makes room (the longest
    # idle by the proxy's one-second clock: here any of the three)
    reader, writer = await open_raw(proxy)
    writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
    [(status, _, _)] = await read_responses(reader, 1)
    assert status == 200
    ends = [asyncio.ensure_future(r.read()) for r, _ in held]
    done, _ = await asyncio.wait(ends, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert [end.result() for end in done] == [b""], "exactly one idle connection closed"
    closed = ends.index(done.pop())
    for end in ends:
        end.cancel()
    await close(held.pop(closed)[1])
    held.append((reader, writer))
    # none idle (each is inside a request head): the next one is refused
    for _, busy in held:
        busy.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n")
        await busy.drain()

    async def refused() -> bool:
        reader, writer = await open_raw(proxy)
        writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
        [(status, headers, body)] = await read_responses(reader, 1)
        await close(writer)
        if status != 503:
            return False  # the partial heads had not all arrived yet: that one was idle
        assert headers[b"retry-after"] == b"1"
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        return True

    await wait_until(refused, 10, "a refusal with no idle connection to close")
    await close(held.pop()[1])

    async def admitted():
        reader, writer = await open_raw(proxy)
        writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\n\r\n")
        responses = await read_responses(reader, 1)
        await close(writer)
        return responses and responses[0][0] == 200

    await wait_until(admitted, 10, "a freed connection slot")
    for _, writer in held:
        await close(writer)


async def test_early_worker_answer_is_relayed_not_502(in_process, test_app):
    """aiohttp answers 413 to a body over its client_max_size (1 MiB) once it has read
    that much, and closes; the upload is still being written (it announces 64 MiB and
    sends at most 8: were the whole body sent, the answer could rightly keep the
    connection)."""
    proxy = await in_process(workers=1, app=test_app)
    statuses = []
    for _ in range(30):
        reader, writer = await open_raw(proxy)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (64 << 20))

        async def upload(writer=writer):
            try:
                for _ in range(128):
                    writer.write(b"x" * 65536)
                    await writer.drain()
            except ConnectionError:
                pass

        sending = asyncio.ensure_future(upload())
        responses = await read_responses(reader, 1)
        statuses.append(responses[0][0] if responses else None)
        assert responses[0][1][b"connection"] == b"close"
        sending.cancel()
        await close(writer)
    assert statuses == [413] * 30
