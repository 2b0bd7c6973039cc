"""Closed-loop HTTP/1.1 load generator on raw asyncio protocols (runs in its own process).

    python bench/loadgen.py PLAN.json --connections 64 --seconds 5

PLAN.json names the targets, the path and the sessions:

    {"targets": [{"tcp": "127.0.0.1:8000"}, {"unix": "/run/w0.sock"}],
     "path": "/increment_counter",
     "sessions": [[0, "x-nemo-gym-session-token: v2....\\r\\n"], ...]}

Connection i goes to target i mod T and keeps one keep-alive request in flight at a time.
Sessions are one shared pool per target, as NeMo Gym's clients use theirs: each request
takes the target's next session, so one session's calls arrive on many connections.
Built on httptools and uvloop so it costs far less CPU per request than the servers it
measures. Prints one JSON line: requests and seconds of the measured window, total
(with the warm-up), errors, p50/p99/p99.9 in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import Any

import httptools
import orjson
import uvloop

BODY = b'{"count": 1}'


class Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    async def send(self, request: bytes) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)  # type: ignore[union-attr]
        return await self.waiter


def request(path: bytes, extra: bytes) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n" % len(BODY) + extra + b"\r\n" + BODY
    )


async def connect(target: dict[str, str]) -> Conn:
    loop = asyncio.get_running_loop()
    if "unix" in target:
        _, conn = await loop.create_unix_connection(Conn, target["unix"])
    else:
        host, port = target["tcp"].rsplit(":", 1)
        _, conn = await loop.create_connection(Conn, host, int(port))
    return conn


async def client(
    target: dict[str, str],
    requests: Any,
    deadline: float,
    out: list[float],
    errors: list[str],
) -> None:
    clock = time.perf_counter
    conn = None
    while clock() < deadline:
        if conn is None:
            try:
                conn = await connect(target)
            except OSError as exc:
                errors.append(type(exc).__name__)
                await asyncio.sleep(0.05)
                continue
        req = next(requests)
        start = clock()
        try:
            status = await conn.send(req)
        except ConnectionError as exc:
            errors.append(type(exc).__name__)
            conn = None
            continue
        out.append(clock() - start)
        if status != 200:
            errors.append(str(status))
    if conn is not None:
        conn.transport.close()  # type: ignore[union-attr]


async def main(args: argparse.Namespace, plan: dict[str, Any]) -> None:
    targets = plan["targets"]
    path = plan.get("path", "/increment_counter").encode()
    pools = []
    for index in range(len(targets)):
        extras = [s[1].encode() for s in plan["sessions"] if s[0] == index] or [""]
        pools.append(itertools.cycle([request(path, extra) for extra in extras]))
    latencies: list[float] = []
    errors: list[str] = []
    # Warm up connections before the clock starts.
    deadline = time.perf_counter() + args.seconds + args.warmup
    tasks = [
        asyncio.create_task(
            client(targets[i % len(targets)], pools[i % len(targets)], deadline, latencies, errors)
        )
        for i in range(args.connections)
    ]
    await asyncio.sleep(args.warmup)
    first, first_errors = len(latencies), len(errors)
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    measured = sorted(latencies[first:])
    count = len(measured)

    def pick(q: float) -> float:
        return measured[min(count - 1, int(q * count))] * 1000 if count else 0.0

    print(
        orjson.dumps(
            {
                "requests": count,
                "total": len(latencies),
                "seconds": elapsed,
                "errors": len(errors) - first_errors,
                "error_kinds": sorted(set(errors)),
                "p50_ms": pick(0.50),
                "p99_ms": pick(0.99),
                "p999_ms": pick(0.999),
            }
        ).decode()
    )
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    with open(args.plan, "rb") as plan_file:
        plan = orjson.loads(plan_file.read())
    uvloop.run(main(args, plan))
