"""Request smuggling: whatever the head says, exactly the requests the proxy parsed reach
the worker, with the proxy's own framing, over pooled connections that stay in sync.

The oracle: one worker records the path of every request its HTTP parser produced
(`/seen`); after each attack, a canary session on another client connection (which
reuses the pooled worker connection, the only worker's) must get its own, exact answer
at once: a worker connection pooled out of step would leave it unanswered.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httptools
import orjson
import pytest

from tests.raw_http import Responses, close, open_raw, read_responses

TOKEN = "X-NeMo-Gym-Session-Token"
SMUGGLED = (
    b"GET /smuggled HTTP/1.1\r\nHost: x\r\nx-ng-session-id: forged\r\n"
    b"x-ng-session-token: forged\r\n\r\n"
)
L = len(SMUGGLED)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def head(*lines: str, method: str = "POST", path: str = "/echo", version: str = "1.1") -> bytes:
    return (f"{method} {path} HTTP/{version}\r\nHost: t\r\n" + "".join(lines) + "\r\n").encode()


UPGRADE = "Connection: Upgrade\r\nUpgrade: websocket\r\n"
WEBSOCKET = "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


async def final_status(reader, within: float = 10.0) -> int | None:
    """The status of the first final response (a 101 counts: the tunnel starts)."""
    parsed = Responses()
    try:
        async with asyncio.timeout(within):
            while not any(status >= 200 for status, _, _ in parsed.done):
                data = await reader.read(65536)
                if not data:
                    break
                parsed.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return parsed.parser.get_status_code()
    return next((status for status, _, _ in parsed.done if status >= 200), None)


# name -> (raw request, expected status, requests that must reach the worker)
SHAPES: dict[str, tuple[bytes, int, int]] = {
    # llhttp frames these; the listed framing header must not be dropped
    "connection-names-content-length": (
        head("Connection: content-length\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        200,
        1,
    ),
    "connection-names-it-among-others": (
        head("Connection: keep-alive, Content-Length, x-a\r\n", f"Content-Length: {L}\r\n")
        + SMUGGLED,
        200,
        1,
    ),
    "connection-names-transfer-encoding": (
        head("Connection: transfer-encoding\r\n", "Transfer-Encoding: chunked\r\n")
        + chunked(SMUGGLED),
        200,
        1,
    ),
    "connection-names-host": (
        head("Connection: host\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        200,
        1,
    ),
    "get-with-a-body": (
        head(f"Content-Length: {L}\r\n", method="GET", path="/whoami") + SMUGGLED,
        200,
        1,
    ),
    "chunked-with-identity-trailer": (
        head("Transfer-Encoding: chunked\r\n")
        + b"3\r\nabc\r\n0\r\nx-ng-session-id: forged\r\n\r\n",
        200,
        1,
    ),
    "content-length-leading-zeros": (
        head(f"Content-Length: 000{L}\r\n") + SMUGGLED,
        200,
        1,
    ),
    # refused before anything reaches a worker
    "content-length-and-transfer-encoding": (
        head(f"Content-Length: {L}\r\n", "Transfer-Encoding: chunked\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-and-content-length": (
        head("Transfer-Encoding: chunked\r\n", "Content-Length: 4\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "two-equal-content-lengths": (
        head(f"Content-Length: {L}\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "two-different-content-lengths": (
        head("Content-Length: 0\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "content-length-list": (head(f"Content-Length: {L}, {L}\r\n") + SMUGGLED, 400, 0),
    "content-length-plus": (head(f"Content-Length: +{L}\r\n") + SMUGGLED, 400, 0),
    "content-length-space-before-colon": (
        head(f"Content-Length : {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "transfer-encoding-xchunked": (
        head("Transfer-Encoding: xchunked\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-space-before-colon": (
        head("Transfer-Encoding : chunked\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-vertical-tab": (
        head("Transfer-Encoding:\x0bchunked\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-chunked-then-gzip": (
        head("Transfer-Encoding: chunked, gzip\r\n") + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-twice": (
        head("Transfer-Encoding: chunked\r\n", "Transfer-Encoding: chunked\r\n")
        + chunked(SMUGGLED),
        400,
        0,
    ),
    "transfer-encoding-identity": (head("Transfer-Encoding: identity\r\n") + SMUGGLED, 400, 0),
    "transfer-encoding-gzip-chunked": (
        head("Transfer-Encoding: gzip, chunked\r\n") + chunked(SMUGGLED),
        501,
        0,
    ),
    "transfer-encoding-in-http-1.0": (
        head("Transfer-Encoding: chunked\r\n", version="1.0") + chunked(SMUGGLED),
        400,
        0,
    ),
    "bare-lf-line-ends": (
        f"POST /echo HTTP/1.1\nHost: t\nContent-Length: {L}\n\n".encode() + SMUGGLED,
        400,
        0,
    ),
    "bare-lf-inside-a-header": (
        head(f"X-A: a\nContent-Length: {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "nul-in-a-header-value": (
        head("X-A: a\x00b\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "obs-fold": (
        head("X-A: a\r\n b\r\n", f"Content-Length: {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "obs-fold-content-length": (
        head(f"Content-Length:\r\n {L}\r\n") + SMUGGLED,
        400,
        0,
    ),
    "two-hosts": (head("Host: u\r\n", f"Content-Length: {L}\r\n") + SMUGGLED, 400, 0),
    "http-0.9": (b"GET /whoami\r\n\r\n", 505, 0),
    # An upgrade the worker declines (or accepts): the request, its body and whatever the
    # client sent behind it must not leave the pooled worker connection out of step.
    # Each case ends with a second request behind the upgrade: it is never served.
    **{
        f"upgrade-{name}": (raw + SMUGGLED, status, reached)
        for name, (raw, status, reached) in {
            "declined-with-a-body": (
                head(UPGRADE, f"Content-Length: {L}\r\n", path="/answer") + SMUGGLED,
                200,
                1,
            ),
            "declined-with-a-chunked-body": (
                head(UPGRADE, "Transfer-Encoding: chunked\r\n", path="/answer") + chunked(SMUGGLED),
                200,
                1,
            ),
            "declined-with-expect-100-continue": (
                head(UPGRADE, "Expect: 100-continue\r\n", f"Content-Length: {L}\r\n").replace(
                    b"/echo", b"/answer"
                )
                + SMUGGLED,
                200,
                1,
            ),
            "declined-400-with-a-body": (
                head(UPGRADE, f"Content-Length: {L}\r\n", path="/answer?status=400") + SMUGGLED,
                400,
                1,
            ),
            "declined-without-a-body": (head(UPGRADE, method="GET", path="/whoami"), 200, 1),
            "accepted-101-with-a-body": (
                head(UPGRADE, WEBSOCKET, f"Content-Length: {L}\r\n", method="GET", path="/ws")
                + SMUGGLED,
                101,
                1,
            ),
            "accepted-101": (head(UPGRADE, WEBSOCKET, method="GET", path="/ws"), 101, 1),
            "worker-closes-early": (
                head(UPGRADE, f"Content-Length: {L}\r\n", path="/answer?close=1") + SMUGGLED,
                502,
                1,
            ),
        }.items()
    },
}


async def test_every_shape_reaches_the_worker_as_exactly_one_request(in_process, http, test_app):
    proxy = await in_process(
        workers=1, app=test_app
    )  # one worker: one pooled connection, one record of paths
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 0}) as resp:
        canary = resp.headers[TOKEN]
    expected_count = 0

    async def seen() -> list[str]:
        async with http.get(f"{proxy.url}/seen") as resp:
            return (await resp.json())["paths"]

    failures = []
    for name, (raw, status, reached) in SHAPES.items():
        before = len(await seen())
        reader, writer = await open_raw(proxy)
        writer.write(raw)
        got = await final_status(reader)
        await close(writer)
        # the canary, on a new client connection that reuses the pooled worker connection
        try:
            async with http.post(
                f"{proxy.url}/increment_counter",
                json={"count": 1},
                headers={TOKEN: canary},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                raw_reply = await resp.read()
                try:
                    canary_reply = (resp.status, orjson.loads(raw_reply))
                except orjson.JSONDecodeError:
                    canary_reply = (resp.status, {"not_json": raw_reply.decode("replace")})
        except TimeoutError:
            canary_reply = (0, {"no_answer": "within 5 s (a worker connection out of step)"})
        expected_count += 1
        # the list holds the /seen call that measured `before`; the canary's path is last
        paths = (await seen())[before + 1 :]
        attack_paths = paths[:-1] if paths and paths[-1] == "/increment_counter" else paths
        if got != status:
            failures.append(f"{name}: status {got}, expected {status}")
        if "/smuggled" in paths or len(attack_paths) != reached:
            failures.append(f"{name}: the worker saw {attack_paths}, expected {reached} request")
        if canary_reply != (200, {"count": expected_count}):
            failures.append(f"{name}: canary got {canary_reply}")
            expected_count = canary_reply[1].get("count", expected_count)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "framing",
    [
        "Connection: content-length\r\nContent-Length: {n}\r\n",
        "Connection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n",
    ],
)
async def test_worker_sees_the_proxys_framing(shared_proxy, framing):
    proxy = shared_proxy(workers=1)
    body = b'{"echo": "framed"}'
    raw = head(framing.format(n=len(body)), path="/whoami")
    raw += chunked(body) if "chunked" in framing else body
    reader, writer = await open_raw(proxy)
    writer.write(raw)
    [(status, _, reply)] = await read_responses(reader, 1)
    await close(writer)
    assert status == 200
    headers = orjson.loads(reply)["headers"]
    if "chunked" in framing:
        assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
    else:
        assert headers["content-length"] == str(len(body)) and "transfer-encoding" not in headers
    assert "connection" not in headers and headers["host"] == "t"


async def test_pipelined_attack_cannot_desync_the_pool(in_process, http, test_app):
    """Many attacks and honest requests interleaved on many connections at once."""
    proxy = await in_process(workers=2, app=test_app)
    tokens = []
    for i in range(8):
        async with http.post(f"{proxy.url}/seed_session", json={"initial_count": i}) as resp:
            tokens.append(resp.headers[TOKEN])
    attack = SHAPES["connection-names-content-length"][0]

    async def attacker():
        for _ in range(25):
            reader, writer = await open_raw(proxy)
            writer.write(attack * 2)
            responses = await read_responses(reader, 2)
            await close(writer)
            assert [r[0] for r in responses] == [200, 200]
            assert all(r[2] == SMUGGLED for r in responses)

    async def honest(i, token):
        for step in range(25):
            async with http.post(
                f"{proxy.url}/increment_counter", json={"count": 1}, headers={TOKEN: token}
            ) as resp:
                assert (resp.status, await resp.json()) == (200, {"count": i + step + 1})

    await asyncio.gather(
        *(attacker() for _ in range(4)), *(honest(i, t) for i, t in enumerate(tokens))
    )
