"""Sessions that follow load: a skewed load, static placement against `--rebalance`.

    .venv/bin/python bench/rebalance.py [--seconds 60] [--workers 4] [--heavy 2]
                                        [--light 32] [--think 0.3] [--block 0.1] [--rounds 2]
                                        [--cpu] [--pause LOW HIGH] [--settle 10]
    .venv313/bin/python bench/rebalance.py --app nemo_gym ...

The app is gym-proxy's counter with `/block` (`bench/skewed_app.py`), or with `--app
nemo_gym` NeMo Gym's own counter server with `/block` (`bench/skewed_nemo_gym.py`: the
released package's `StatefulCounterResourcesServer`, its session dict declared so that
its sessions move, called as NeMo Gym's agents call it, by the cookies of the last
response; it needs the NeMo Gym tier's venv). A few heavy
sessions call `/block` back to back (each call blocks its worker's event loop `--block`
seconds: a synchronous call, as in NeMo Gym#3039; with `--cpu` it computes for that much
CPU time instead of sleeping, so the heavy workers also take the machine's cores); many
light sessions call `/increment_counter`, each pausing about `--think` seconds between
calls (drawn from 0.5-1.5 times it, or from `--pause LOW HIGH`: a model generating
between two tool calls). The heavy sessions start first, so each takes a worker of its
own; the light ones spread over every worker, and those that share a worker with a
heavy one wait behind its blocks. Two servers, one after the other, alternating for
`--rounds` rounds: gym-proxy as it is (static), and with `--rebalance`.

Per server: the light calls' p50/p99 over the whole run, over the calls sent from
`--settle` seconds after the load started (the rebalance has had its time) and over its
second half, the heavy and total calls per second, the sessions a rebalance moved (and
how often the one moved most was moved, a heavy session's moves, the last move's time
after the load started: `status`' `rebalance.recent`), and whether every light
session's counter is exact at the end.
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
CONTROL = "bench-control"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Session:
    """One session's calls: to gym-proxy's counter with its token header, to NeMo Gym's
    with the cookies of the last response (as NeMo Gym's agents make them)."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.headers: dict[str, str] = {}
        self.cookies: dict[str, str] = {}

    async def call(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        async with self.http.post(
            f"{self.url}{path}", json=body or {}, headers=self.headers,
            cookies=self.cookies or None,
        ) as response:  # fmt: skip
            payload = await response.read()
            if TOKEN in response.headers:
                self.headers = {TOKEN: response.headers[TOKEN]}
            self.cookies.update({name: m.value for name, m in response.cookies.items()})
            return response.status, orjson.loads(payload) if payload else None

    async def seed(self) -> Session:
        status, body = await self.call("/seed_session", {"initial_count": 0})
        assert status == 200, body
        return self

    @property
    def session_id(self) -> str:
        """The gym-proxy session (`v2.<instance>.<session>.<owner>.<mac>`); NeMo Gym's
        calls carry cookies, and its moves are told by the app's own session IDs."""
        token = self.headers.get(TOKEN, "")
        return token.split(".")[2] if token.count(".") >= 4 else ""


async def moves(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """The latest rebalances (`status`' `rebalance.recent`, at most 32)."""
    async with http.get(
        f"{url}/ng-control/v1/checkpoint/status", headers={"Authorization": f"Bearer {CONTROL}"}
    ) as response:
        status = await response.json()
    return list(status.get("rebalance", {}).get("recent", []))


async def load(port: int, opts: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits, cookie_jar=aiohttp.DummyCookieJar()) as http:
        heavy = [await Session(http, url).seed() for _ in range(opts.heavy)]
        light = [await Session(http, url).seed() for _ in range(opts.light)]
        start, started_unix = time.monotonic(), time.time()
        end = start + opts.seconds
        half = start + opts.seconds / 2
        settled = start + opts.settle
        low, high = opts.pause or (0.5 * opts.think, 1.5 * opts.think)
        latencies: list[tuple[float, float]] = []
        done = dict.fromkeys(light, 0)
        heavy_calls = 0
        errors = 0
        pauses = random.Random(7)

        async def light_loop(session: Session) -> None:
            nonlocal errors
            while time.monotonic() < end:
                sent = time.monotonic()
                status, _ = await session.call("/increment_counter", {"count": 1})
                if status == 200:
                    done[session] += 1
                else:
                    errors += 1
                latencies.append((sent, time.monotonic() - sent))
                # Drawn, not fixed: a fixed pause that is a multiple of --block falls into
                # step with the blocks and never waits behind one.
                await asyncio.sleep(pauses.uniform(low, high))

        async def heavy_loop(session: Session) -> None:
            nonlocal heavy_calls, errors
            while time.monotonic() < end:
                cpu = "&cpu=1" if opts.cpu else ""
                status, _ = await session.call(f"/block?seconds={opts.block}{cpu}")
                heavy_calls += status == 200
                errors += status != 200

        await asyncio.gather(*map(heavy_loop, heavy), *map(light_loop, light))
        elapsed = time.monotonic() - start
        exact = True
        for session, calls in done.items():
            _, body = await session.call("/get_counter_value")
            exact &= body["count"] == calls
        events = await moves(http, url)
    every = [lat for _, lat in latencies]
    later = [lat for sent, lat in latencies if sent >= half]
    after = [lat for sent, lat in latencies if sent >= settled]
    per_session: dict[str, int] = {}
    for event in events:
        for session_id in event["moved"]:
            per_session[session_id] = per_session.get(session_id, 0) + 1
    heavy_ids = {s.session_id for s in heavy}
    return {
        "light_p50_ms": 1000 * statistics.median(every),
        "light_p99_ms": 1000 * percentile(every, 0.99),
        "light_p99_settled_ms": 1000 * percentile(after, 0.99),
        "light_p99_late_ms": 1000 * percentile(later, 0.99),
        "most_moves": max(per_session.values(), default=0),
        "heavy_moves": sum(n for sid, n in per_session.items() if sid in heavy_ids),
        "last_move_s": max((e["at"] - started_unix for e in events), default=None),
        "timeline": [
            [
                round(e["at"] - started_unix, 1),
                e["slot"],
                e["why"],
                len(e["moved"]),
                len(e.get("kept", {})),
            ]
            for e in events
        ],
        "light_rps": len(every) / elapsed,
        "heavy_rps": heavy_calls / elapsed,
        "total_rps": (len(every) + heavy_calls) / elapsed,
        "errors": errors,
        "exact": exact,
    }


def run_server(kind: str, opts: argparse.Namespace) -> dict[str, Any]:
    extra = ["--control-token", CONTROL]
    extra += ["--log-level", "info", "--rebalance"] if kind == "rebalance" else []
    if opts.app == "nemo_gym":
        import skewed_nemo_gym as nemo_gym  # NeMo Gym's venv only

        # --preload as docs/nemo_gym.md recommends; its session dict, so that they move
        extra += ["--name", nemo_gym.INSTANCE, "--preload"]
        extra += ["--session-state", nemo_gym.SESSION_STATE]
        app, env = "skewed_nemo_gym:SkewedCounter", nemo_gym.config_env()
    else:
        app, env = "skewed_app:create_app", {}
    proxy = GymProxy(opts.workers, *extra, app=app, env=env)
    try:
        cell = asyncio.run(load(proxy.port, opts))
        log = proxy.log.read_text()
    finally:
        proxy.stop()
    for at, slot, why, count, kept in cell["timeline"]:
        print(f"    {at:+6.1f} s worker {slot} ({why}) shed {count}, kept {kept}", file=sys.stderr)
    for line in log.splitlines():
        if "rebalance" in line:
            print("   ", line[24:], file=sys.stderr)
    moved = re.findall(r"rebalance: .* shed (\d+) of", log)
    cell["moved"] = sum(map(int, moved))
    cell["rebalances"] = len(moved)
    print(f"  {kind:<9} light p99 {cell['light_p99_ms']:.1f} ms (from {opts.settle:g} s "
          f"{cell['light_p99_settled_ms']:.1f}, late half {cell['light_p99_late_ms']:.1f}), "
          f"{cell['total_rps']:.0f} req/s, moved {cell['moved']} (most {cell['most_moves']}, "
          f"heavy {cell['heavy_moves']}, last at {_seconds(cell['last_move_s'])}), "
          f"exact {cell['exact']}", file=sys.stderr)  # fmt: skip
    return cell


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def table(rounds: list[dict[str, dict[str, Any]]], settle: float) -> str:
    lines = [
        f"| round | server | light p50 ms | light p99 ms | p99 from {settle:g} s | "
        "p99, 2nd half | light req/s | heavy req/s | total req/s | sessions moved | "
        "moved most | heavy moved | last move | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for number, cells in enumerate(rounds, 1):
        for kind, c in cells.items():
            lines.append(
                f"| {number} | {kind} | {c['light_p50_ms']:.1f} | {c['light_p99_ms']:.1f} | "
                f"{c['light_p99_settled_ms']:.1f} | {c['light_p99_late_ms']:.1f} | "
                f"{c['light_rps']:.0f} | {c['heavy_rps']:.1f} | {c['total_rps']:.0f} | "
                f"{c['moved']} | {c['most_moves']} | {c['heavy_moves']} | "
                f"{_seconds(c['last_move_s'])} | {c['exact']} |"
            )
        static, balanced = cells["static"], cells["rebalance"]
        lower = [
            f"{static[key] / balanced[key]:.1f}x lower"
            for key in ("light_p99_ms", "light_p99_settled_ms", "light_p99_late_ms")
        ]
        throughput = balanced["total_rps"] / static["total_rps"]
        row = ["", *lower, "", "", f"{throughput:.2f}x", "", "", "", "", ""]
        lines.append(f"| {number} | ratio | {' | '.join(row)} |")
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
    parser.add_argument("--app", choices=("gym_proxy", "nemo_gym"), default="gym_proxy")
    parser.add_argument("--cpu", action="store_true", help="heavy calls compute, not sleep")
    parser.add_argument(
        "--pause", type=float, nargs=2, metavar=("LOW", "HIGH"),
        help="light sessions pause LOW-HIGH seconds between calls (default: 0.5-1.5 x --think)",
    )  # fmt: skip
    parser.add_argument(
        "--settle", type=float, default=10.0, help="p99 of the light calls sent from then on"
    )
    opts = parser.parse_args()
    rounds = []
    for number in range(opts.rounds):
        print(f"round {number + 1}", file=sys.stderr)
        rounds.append({kind: run_server(kind, opts) for kind in ("static", "rebalance")})
    print(table(rounds, opts.settle))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"rebalance-{opts.app}-{stamp}.json"
    raw = {"options": vars(opts), "rounds": rounds}
    out.write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print(f"\nraw results: {out.relative_to(HERE.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
