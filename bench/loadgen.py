"""Closed-loop HTTP/1.1 load generator on raw asyncio protocols (runs in its own process).

Each connection keeps one keep-alive request in flight at a time. Built on httptools and
uvloop so it costs far less CPU per request than the server side it measures.

    python bench/loadgen.py --tcp 127.0.0.1:8000 --connections 64 --seconds 5
    python bench/loadgen.py --unix /run/w0.sock --unix /run/w1.sock --direct ...

With `--direct` every connection names its session in `x-ng-session-id` (as the proxy
would); otherwise each connection first seeds a session through the proxy and then sends
its token. Prints one JSON line: requests and seconds of the measured window, total (with the
warm-up), errors, p50_ms, p99_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httptools
import orjson
import uvloop

BODY = b'{"count": 1}'


class Conn(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[None] | None = None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, dict[bytes, bytes]]] | None = None
        self.headers: dict[bytes, bytes] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))

    def on_message_begin(self) -> None:
        self.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), self.headers))

    async def send(self, request: bytes) -> tuple[int, dict[bytes, bytes]]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)  # type: ignore[union-attr]
        return await self.waiter


def request(path: bytes, extra: bytes) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n" % len(BODY) + extra + b"\r\n" + BODY
    )


async def connect(args: argparse.Namespace, index: int) -> Conn:
    loop = asyncio.get_running_loop()
    if args.unix:
        path = args.unix[index % len(args.unix)]
        _, conn = await loop.create_unix_connection(Conn, path)
    else:
        host, port = args.tcp.rsplit(":", 1)
        _, conn = await loop.create_connection(Conn, host, int(port))
    return conn


async def client(
    args: argparse.Namespace, index: int, deadline: float, out: list[float], errors: list[int]
) -> None:
    conn = await connect(args, index)
    if args.direct:
        extra = b"x-ng-session-id: bench-%d\r\n" % index
    else:
        status, headers = await conn.send(request(b"/seed_session", b""))
        extra = b"x-nemo-gym-session-token: " + headers[b"x-nemo-gym-session-token"] + b"\r\n"
    req = request(b"/increment_counter", extra)
    clock = time.perf_counter
    while True:
        start = clock()
        if start >= deadline:
            break
        status, _ = await conn.send(req)
        out.append(clock() - start)
        if status != 200:
            errors.append(status)
    conn.transport.close()  # type: ignore[union-attr]


async def main(args: argparse.Namespace) -> None:
    latencies: list[float] = []
    errors: list[int] = []
    # Warm up connections and sessions before the clock starts.
    deadline = time.perf_counter() + args.seconds + args.warmup
    tasks = [
        asyncio.create_task(client(args, i, deadline, latencies, errors))
        for i in range(args.connections)
    ]
    await asyncio.sleep(args.warmup)
    first = len(latencies)
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    measured = sorted(latencies[first:])
    count = len(measured)
    pick = lambda q: measured[min(count - 1, int(q * count))] * 1000 if count else 0.0  # noqa: E731
    print(
        orjson.dumps(
            {
                "requests": count,
                "total": len(latencies),
                "seconds": elapsed,
                "errors": len(errors),
                "p50_ms": pick(0.50),
                "p99_ms": pick(0.99),
            }
        ).decode()
    )
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tcp")
    parser.add_argument("--unix", action="append")
    parser.add_argument("--direct", action="store_true")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    uvloop.run(main(parser.parse_args()))
