"""Placement that follows load: a skewed load, static placement against `--rebalance`.

    .venv/bin/python bench/rebalance.py [--seconds 60] [--workers 4] [--heavy 2]
                                        [--light 32] [--think 0.3] [--block 0.1] [--rounds 2]

The app is gym-proxy's counter with `/block` (`bench/skewed_app.py`). A few heavy
sessions call `/block` back to back (each call blocks its worker's event loop `--block`
seconds: a synchronous call, as in NeMo Gym#3039); many light sessions call
`/increment_counter`, each pausing about `--think` seconds between calls (drawn from
0.5-1.5 times it: a model generating between two tool calls). The heavy sessions start
first, so each takes a worker of its own; the light ones spread over every worker, and
those that share a worker with a heavy one wait behind its blocks. Two servers, one
after the other, alternating for `--rounds` rounds: gym-proxy as it is (static), and
with `--rebalance`.

Per server: the light calls' p50/p99 over the whole run and over its second half (after
the rebalance had its time), the heavy and total calls per second, the sessions a
rebalance moved, and whether every light session's counter is exact at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from servers import GymProxy

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TOKEN = "x-nemo-gym-session-token"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def seed(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/seed_session", json={"initial_count": 0}) as response:
        assert response.status == 200, await response.text()
        return response.headers[TOKEN]


async def load(port: int, opts: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits, cookie_jar=aiohttp.DummyCookieJar()) as http:
        heavy = [await seed(http, url) for _ in range(opts.heavy)]
        light = [await seed(http, url) for _ in range(opts.light)]
        start = time.monotonic()
        end = start + opts.seconds
        half = start + opts.seconds / 2
        latencies: list[tuple[float, float]] = []
        done = dict.fromkeys(light, 0)
        heavy_calls = 0
        errors = 0
        pauses = random.Random(7)

        async def light_loop(token: str) -> None:
            nonlocal errors
            while time.monotonic() < end:
                sent = time.monotonic()
                async with http.post(
                    f"{url}/increment_counter", json={"count": 1}, headers={TOKEN: token}
                ) as response:
                    await response.read()
                    if response.status == 200:
                        done[token] += 1
                    else:
                        errors += 1
                latencies.append((sent, time.monotonic() - sent))
                # Drawn, not fixed: a fixed pause that is a multiple of --block falls into
                # step with the blocks and never waits behind one.
                await asyncio.sleep(pauses.uniform(0.5, 1.5) * opts.think)

        async def heavy_loop(token: str) -> None:
            nonlocal heavy_calls, errors
            while time.monotonic() < end:
                async with http.post(
                    f"{url}/block?seconds={opts.block}", headers={TOKEN: token}
                ) as response:
                    await response.read()
                    heavy_calls += response.status == 200
                    errors += response.status != 200

        await asyncio.gather(*map(heavy_loop, heavy), *map(light_loop, light))
        elapsed = time.monotonic() - start
        exact = True
        for token, calls in done.items():
            async with http.post(
                f"{url}/get_counter_value", json={}, headers={TOKEN: token}
            ) as response:
                exact &= (await response.json())["count"] == calls
    every = [lat for _, lat in latencies]
    later = [lat for sent, lat in latencies if sent >= half]
    return {
        "light_p50_ms": 1000 * statistics.median(every),
        "light_p99_ms": 1000 * percentile(every, 0.99),
        "light_p99_late_ms": 1000 * percentile(later, 0.99),
        "light_rps": len(every) / elapsed,
        "heavy_rps": heavy_calls / elapsed,
        "total_rps": (len(every) + heavy_calls) / elapsed,
        "errors": errors,
        "exact": exact,
    }


def run_server(kind: str, opts: argparse.Namespace) -> dict[str, Any]:
    extra = ["--log-level", "info", "--rebalance"] if kind == "rebalance" else []
    proxy = GymProxy(opts.workers, *extra, app="skewed_app:create_app")
    try:
        cell = asyncio.run(load(proxy.port, opts))
        log = proxy.log.read_text()
    finally:
        proxy.stop()
    moved = re.findall(r"rebalance: .* shed (\d+) of", log)
    cell["moved"] = sum(map(int, moved))
    cell["rebalances"] = len(moved)
    print(f"  {kind:<9} light p99 {cell['light_p99_ms']:.1f} ms (late half "
          f"{cell['light_p99_late_ms']:.1f}), {cell['total_rps']:.0f} req/s, "
          f"moved {cell['moved']}, exact {cell['exact']}", file=sys.stderr)  # fmt: skip
    return cell


def table(rounds: list[dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| round | server | light p50 ms | light p99 ms | p99, 2nd half | light req/s | "
        "heavy req/s | total req/s | sessions moved | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for number, cells in enumerate(rounds, 1):
        for kind, c in cells.items():
            lines.append(
                f"| {number} | {kind} | {c['light_p50_ms']:.1f} | {c['light_p99_ms']:.1f} | "
                f"{c['light_p99_late_ms']:.1f} | {c['light_rps']:.0f} | {c['heavy_rps']:.1f} | "
                f"{c['total_rps']:.0f} | {c['moved']} | {c['exact']} |"
            )
        static, balanced = cells["static"], cells["rebalance"]
        lines.append(
            f"| {number} | ratio | | {static['light_p99_ms'] / balanced['light_p99_ms']:.1f}x "
            f"lower | {static['light_p99_late_ms'] / balanced['light_p99_late_ms']:.1f}x lower | "
            f"| | {balanced['total_rps'] / static['total_rps']:.2f}x | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--heavy", type=int, default=2)
    parser.add_argument("--light", type=int, default=32)
    parser.add_argument("--think", type=float, default=0.3)
    parser.add_argument("--block", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    rounds = []
    for number in range(opts.rounds):
        print(f"round {number + 1}", file=sys.stderr)
        rounds.append({kind: run_server(kind, opts) for kind in ("static", "rebalance")})
    print(table(rounds))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"rebalance-{stamp}.json"
    raw = {"options": vars(opts), "rounds": rounds}
    out.write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print(f"\nraw results: {out.relative_to(HERE.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
