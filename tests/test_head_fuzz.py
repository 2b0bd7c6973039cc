"""A seeded mutation fuzzer over request heads, against the real proxy and one worker.

Every case mutates a request that carries a smuggling payload in its body, sends it on a
fresh connection, and reads whatever comes back. The oracle, checked as it goes:
- every request the worker parsed arrived with a proxy-minted `x-ng-session-id`: a request
  the proxy did not parse itself would lack it, or carry the payload's `forged` (a
  mutation may turn the payload into a real pipelined request; the proxy then parses it
  and gives it its own identity, which is not smuggling);
- a canary session on the pooled worker connection keeps getting its own exact answers.

CI runs FUZZ_CASES cases; `GYM_PROXY_FUZZ_CASES=20000` runs a long one, and
`GYM_PROXY_FUZZ_SEED` picks the seed (printed on failure).
"""

from __future__ import annotations

import asyncio
import os
import random

import aiohttp
import orjson
import pytest

from tests.raw_http import Responses, close, open_raw

TOKEN = "X-NeMo-Gym-Session-Token"
FUZZ_CASES = int(os.environ.get("GYM_PROXY_FUZZ_CASES", "300"))
SEED = int(os.environ.get("GYM_PROXY_FUZZ_SEED", "6006"))
CANARY_EVERY = 10

PAYLOAD = b"GET /smuggled HTTP/1.1\r\nHost: x\r\nx-ng-session-id: forged\r\n\r\n"
TOKENS = [
    b"\r\n", b"\n", b"\r", b"\0", b" ", b"\t", b"\x0b", b":", b",", b";", b"0", b"1", b"9",
    b"-", b"\xff", b"chunked", b"Chunked", b"gzip", b"identity", b"Content-Length",
    b"Transfer-Encoding", b"Connection", b"content-length", b"transfer-encoding", b"close",
    b"keep-alive", b"Host", b"Expect", b"100-continue", b"x-ng-session-id", b"Upgrade",
    b"HTTP/1.0", b"HTTP/1.1", b"0\r\n\r\n", b"\r\n\r\n", PAYLOAD,
    b"websocket", b"upgrade", b"h2c", b"Connection: Upgrade\r\n", b"Upgrade: websocket\r\n",
    b"Connection: keep-alive, Upgrade\r\n", b"Sec-WebSocket-Version: 13\r\n",
]  # fmt: skip


def bases() -> list[bytes]:
    body = PAYLOAD
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return [
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
        b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, content-length\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
        b"POST /whoami HTTP/1.1\r\nHost: t\r\nConnection: transfer-encoding\r\n"
        b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n" + chunked,
        b"GET /whoami HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b"POST /echo HTTP/1.0\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%s"
        % (len(body), body),
        # upgrades the worker declines or accepts, with a body and a request behind them
        b"POST /answer HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: %d\r\n\r\n%s%s" % (len(body), body, body),
        b"POST /answer?status=400 HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\n"
        b"Upgrade: h2c\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + body,
        b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n" + body,
    ]


def mutate(rng: random.Random, original: bytes) -> bytes:
    """One to four random edits: insert a token, delete a span, duplicate or swap lines,
    change a digit or the case of a span."""
    data = bytearray(original)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(data) + 1)
        if op == 0:
            data[at:at] = rng.choice(TOKENS)
        elif op == 1 and data:
            del data[at : at + rng.randint(1, 8)]
        elif op == 2:
            lines = bytes(data).split(b"\r\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            data = bytearray(b"\r\n".join(lines))
        elif op == 3:
            lines = bytes(data).split(b"\r\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
            data = bytearray(b"\r\n".join(lines))
        elif op == 4:
            digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
            if digits:
                data[rng.choice(digits)] = rng.choice(b"0123456789")
        else:
            span = slice(at, at + rng.randint(1, 12))
            data[span] = bytes(data[span]).swapcase()
    return bytes(data)


async def exchange(proxy, raw: bytes) -> list[int]:
    """Send `raw` on a new connection; the statuses received before the proxy closes or
    0.15 s pass quietly."""
    reader, writer = await open_raw(proxy)
    parsed = Responses()
    try:
        writer.write(raw)
        while True:
            data = await asyncio.wait_for(reader.read(65536), 0.15)
            if not data:
                break
            parsed.parser.feed_data(data)
    except (TimeoutError, ConnectionError, Exception):
        pass
    finally:
        await close(writer)
    return [status for status, _, _ in parsed.done]


@pytest.mark.timeout(max(120, FUZZ_CASES // 5))
async def test_mutated_heads_never_smuggle(start_proxy, http):
    proxy = start_proxy(workers=1)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 0}) as resp:
        canary = resp.headers[TOKEN]
    count = 0
    rng = random.Random(SEED)
    corpus = bases()
    checked = 0

    async def check(case: int, raw: bytes) -> None:
        nonlocal count, checked
        async with http.post(
            f"{proxy.url}/increment_counter",
            json={"count": 1},
            headers={TOKEN: canary},
            timeout=aiohttp.ClientTimeout(total=5),  # a worker connection out of step
        ) as resp:
            reply = (resp.status, orjson.loads(await resp.read()))
        count += 1
        assert reply == (200, {"count": count}), (SEED, case, raw)
        async with http.get(f"{proxy.url}/seen") as resp:
            seen = await resp.json()
        new = list(zip(seen["paths"], seen["session_ids"], strict=True))[checked:]
        checked = len(seen["paths"]) + 1  # this /seen call is recorded too
        for path, session_id in new:
            assert session_id not in (None, "forged"), (SEED, case, path, raw)

    for case in range(FUZZ_CASES):
        raw = mutate(rng, rng.choice(corpus))
        await exchange(proxy, raw)
        if case % CANARY_EVERY == CANARY_EVERY - 1:
            await check(case, raw)
    await check(FUZZ_CASES, b"")
