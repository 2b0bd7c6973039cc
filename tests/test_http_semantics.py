"""HTTP/1.1 details of the data path, spoken over raw sockets to the real proxy (the
tests that only read share one: `shared_proxy`)."""

from __future__ import annotations

import asyncio

import orjson

from tests.conftest import ASGI_TEST_APP
from tests.raw_http import close, open_raw, post, read_responses
from tests.support import wait_until

OWNER = "x-ng-session-owner"


async def test_pipelined_requests_answered_in_order(shared_proxy):
    proxy = shared_proxy(workers=2)
    reader, writer = await open_raw(proxy)
    requests = b"".join(
        post("/echo", f"body-{i}".encode(), "Content-Type: text/plain\r\n") for i in range(20)
    )
    writer.write(requests)  # all at once: the proxy must answer one by one, in order
    responses = await read_responses(reader, 20)
    assert [body for _, _, body in responses] == [f"body-{i}".encode() for i in range(20)]
    await close(writer)


async def test_keep_alive_and_http10(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(b"GET /get_counter_value HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    [(status, headers, body)] = await read_responses(reader, 1)
    assert status == 200 and headers[b"connection"].lower() == b"keep-alive"
    writer.write(b"GET /get_counter_value HTTP/1.0\r\n\r\n")  # 1.0 without keep-alive: closes
    [(status, _, _)] = await read_responses(reader, 1)
    assert status == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await close(writer)


async def test_head_then_get_on_one_connection(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(b"HEAD /download?size=1000&length=1 HTTP/1.1\r\nHost: t\r\n\r\n")
    data = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert data.startswith(b"HTTP/1.1 200") and b"content-length: 1000" in data.lower()
    writer.write(b"GET /download?size=1000&length=1 HTTP/1.1\r\nHost: t\r\n\r\n")
    [(status, _, body)] = await read_responses(reader, 1)
    assert status == 200 and len(body) == 1000
    await close(writer)


async def test_expect_100_continue(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    body = b'{"initial_count": 3}'
    writer.write(
        f"POST /seed_session HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
        "Expect: 100-continue\r\n\r\n".encode()
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    [(status, _, reply)] = await read_responses(reader, 1)
    assert status == 200 and orjson.loads(reply) == {"count": 3}
    await close(writer)


async def test_expect_100_with_bad_token_gets_final_answer_without_body(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(
        b"POST /seed_session HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n"
        b"X-NeMo-Gym-Session-Token: %s\r\nExpect: 100-continue\r\n\r\n" % proxy.bad_token.encode()
    )
    [(status, headers, body)] = await read_responses(reader, 1)
    assert status == 400 and headers[b"connection"] == b"close"
    assert orjson.loads(body)["error"]["code"] == "invalid_session_token"
    await close(writer)


async def test_chunked_request_and_error_keeps_connection(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: text/plain\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    [(status, _, body)] = await read_responses(reader, 1)
    assert status == 200 and body == b"hello world"
    # an error with a body: the body is read and dropped, the connection stays usable
    writer.write(post("/echo", b"x" * 5000, f"X-NeMo-Gym-Session-Token: {proxy.bad_token}\r\n"))
    writer.write(post("/echo", b"after", "Content-Type: text/plain\r\n"))
    responses = await read_responses(reader, 2)
    assert [r[0] for r in responses] == [400, 200] and responses[1][2] == b"after"
    await close(writer)


async def test_malformed_request_is_400_and_closed(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(b"THIS IS NOT HTTP\r\n\r\n")
    [(status, headers, body)] = await read_responses(reader, 1)
    assert status == 400 and orjson.loads(body)["error"]["code"] == "bad_request"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await close(writer)


async def test_connect_is_refused(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    [(status, _, body)] = await read_responses(reader, 1)
    assert status == 501 and orjson.loads(body)["error"]["code"] == "upgrade_not_supported"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await close(writer)


async def test_upgrade_the_worker_declines_is_answered_and_closed(shared_proxy):
    proxy = shared_proxy(workers=1)
    reader, writer = await open_raw(proxy)
    writer.write(b"GET /whoami HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    [(status, headers, body)] = await read_responses(reader, 1)
    assert status == 200 and "owner" in orjson.loads(body)
    assert headers.get(b"connection") == b"close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await close(writer)


async def test_client_going_away_cancels_the_worker_request(in_process, http, test_app):
    proxy = await in_process(workers=1, app=test_app)
    async with http.post(f"{proxy.url}/whoami") as resp:
        owner = (await resp.json())["owner"]
    reader, writer = await open_raw(proxy)
    writer.write(
        f"GET /slow?seconds=60&tag=gone HTTP/1.1\r\nHost: t\r\n{OWNER}: {owner}\r\n\r\n".encode()
    )

    async def seen_slow():
        async with http.get(f"{proxy.url}/seen", headers={OWNER: owner}) as resp:
            return "/slow" in (await resp.json())["paths"]

    await wait_until(seen_slow, 10, "the slow request to reach the worker")
    await close(writer)

    async def cancelled():
        async with http.get(f"{proxy.url}/cancelled", headers={OWNER: owner}) as resp:
            return (await resp.json())["cancelled"] == ["gone"]

    await wait_until(cancelled, 10, "the worker handler to be cancelled")


async def test_upstream_timeout_is_504(in_process, http, test_app):
    proxy = await in_process("--upstream-timeout", "1", workers=1, app=test_app)
    async with http.get(f"{proxy.url}/slow?seconds=20") as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
    async with http.get(f"{proxy.url}/slow?seconds=0") as resp:
        assert resp.status == 200  # the worker is fine; only that request timed out


async def test_unreachable_worker_socket_is_502_and_connection_stays_usable(start_proxy):
    proxy = start_proxy(workers=1)
    [socket_path] = proxy.runtime_dir().glob("w0-*.sock")
    socket_path.unlink()  # the worker is registered but cannot be reached any more
    reader, writer = await open_raw(proxy)
    # headers and body in one write: the body is buffered while the proxy connects
    writer.write(post("/echo", b"hello", "Content-Type: text/plain\r\n"))
    [(status, _, body)] = await read_responses(reader, 1)
    assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_connection_lost"
    writer.write(post("/echo", b"again", "Content-Type: text/plain\r\n"))
    [(status, _, _)] = await read_responses(reader, 1)  # must not hang: reading resumed
    assert status == 502
    await close(writer)


async def test_a_sized_answer_leaves_the_worker_head_and_body_together(start_proxy, http):
    """uvicorn writes an answer's head as the app sends it; the worker's door holds a
    sized answer's head until its body, so the proxy reads one piece, not two (its
    reads per NeMo Gym call fell from 2.39 to 2.12). Read from the worker's own socket:
    nothing comes while the app holds its body back, then the head and the body."""
    proxy = start_proxy(workers=1, app=ASGI_TEST_APP)
    [socket_path] = proxy.runtime_dir().glob("w0-*.sock")
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    try:
        writer.write(b"GET /late_body HTTP/1.1\r\nHost: w\r\n\r\n")
        early = asyncio.ensure_future(reader.read(65536))

        async def seen_late_body() -> bool:
            async with http.get(f"{proxy.url}/seen") as resp:
                return "/late_body" in (await resp.json())["paths"]

        await wait_until(seen_late_body, 10, "the app to send its head")
        assert not early.done(), early.result()  # the door holds the head
        async with http.get(f"{proxy.url}/release?name=late_body") as resp:
            assert resp.status == 200
        answer = await asyncio.wait_for(early, 10)
        while not answer.endswith(b"late"):  # both may come in two reads; head first
            answer += await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nlate"), answer
