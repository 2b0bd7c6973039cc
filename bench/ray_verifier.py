"""A Ray-backed verifier's throughput: NeMo Gym's code_gen resources server three ways.

    .venv313/bin/python bench/ray_verifier.py [--verifies 200] [--concurrency 16]
        [--rounds 5] [--ways one,nemo-gym,gym-proxy]

NeMo Gym's released code_gen resources server, unmodified: its /verify extracts the
program from the response's ```python block and runs it on the unit tests as a Ray task
(`check_correctness_remote.remote`, which forks a `multiprocessing.Manager` and a test
process). Served three ways (bench/ray_verifier_ways.py), all started once and kept up,
in rounds that alternate (one, nemo-gym, gym-proxy, one, ...), each round `--verifies`
verifies at `--concurrency` after a warm-up:

- one NeMo Gym process, `python app.py` (its own Ray cluster): the baseline;
- NeMo Gym's own multi-worker path, `num_workers: 2` under its launcher `gym env start`
  (the launcher's one cluster);
- `gym-proxy <class> --nemo-gym-config FILE --workers 2` (gym-proxy's one cluster).

Half the programs are right (reward 1.0 expected), half wrong or crashing (0.0); every
reward is checked. Per way, the medians over rounds of: verifies per second, p50 and p99
latency, CPU milliseconds per verify of every process of the way (server, workers,
launcher, and all of Ray's: `gcs_server`, `raylet`, its daemons, its workers and what
they fork; bench/ray_verifier_procs.py), split into the server's processes, Ray's task
workers and Ray's daemons, with the leader process's share (the server itself, the
launcher, or gym-proxy's proxy); the Ray workers Ray started during a round; the peak of
the summed RSS during the round; the number of Ray clusters (`gcs_server` processes);
and, once, the way's idle CPU over IDLE_SECONDS. Ratios are against the first way.
Writes bench/results/ray-verifier-<date>.json. Needs the NeMo Gym tier's virtualenv
(tests/nemo_gym/install.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.ray_verifier_procs import CATEGORIES, Meter, Usage  # noqa: E402
from bench.ray_verifier_ways import WAYS, Way  # noqa: E402

SAMPLE_EVERY = 0.5  # seconds between samples of a way during a round (RSS, ended workers)
IDLE_SECONDS = 20.0  # how long each way's idle CPU is measured, no verify in flight
REQUEST_TIMEOUT = 300.0
T = TypeVar("T")


def _square_case(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 10**6)
    return f"{n}\n", str(n * n)


def _sum_case(rng: random.Random) -> tuple[str, str]:
    values = [rng.randint(1, 1000) for _ in range(rng.randint(2, 30))]
    return f"{len(values)}\n{' '.join(map(str, values))}\n", str(sum(values))


def _reverse_case(rng: random.Random) -> tuple[str, str]:
    text = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 40)))
    text = text if text != text[::-1] else text + "z"  # a palindrome passes print(input())
    return f"{text}\n", text[::-1]


# Per problem: its right program, wrong ones (a wrong answer, a crash), and one test case
# (stdin, expected stdout) from a random generator.
PROBLEMS: list[tuple[str, list[str], Callable[[random.Random], tuple[str, str]]]] = [
    (
        "n=int(input())\nprint(n*n)",
        ["n=int(input())\nprint(n+1)", "n=int(input())\nprint(n*n, undefined_name)"],
        _square_case,
    ),
    (
        "input()\nprint(sum(map(int, input().split())))",
        ["input()\nprint(max(map(int, input().split())))", "print(1/0)"],
        _sum_case,
    ),
    ("print(input()[::-1])", ["print(input())", "s=input()\nprint(s[::-1][1:])"], _reverse_case),
]


def verify_body(program: str, inputs: list[str], outputs: list[str]) -> dict[str, Any]:
    """A /verify request as code_gen's tests/test_app.py builds one."""
    text = f"Here it is.\n```python\n{program}\n```"
    message = {"id": "msg", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip
    response = {"id": "resp", "created_at": 0.0, "model": "policy", "object": "response",
                "output": [message], "parallel_tool_calls": False, "tool_choice": "auto",
                "tools": []}  # fmt: skip
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "Solve it."}]},
        "response": response,
        "verifier_metadata": {"unit_tests": {"inputs": inputs, "outputs": outputs}},
    }


def verifies(count: int, seed: int) -> list[tuple[bytes, float]]:
    """`count` verify bodies with the reward each must get: half right programs (1.0),
    half wrong answers or crashes (0.0), 3 to 5 unit tests each."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        right, wrongs, case = rng.choice(PROBLEMS)
        tests = [case(rng) for _ in range(rng.randint(3, 5))]
        is_right = i % 2 == 0
        program = right if is_right else rng.choice(wrongs)
        body = verify_body(program, [t[0] for t in tests], [t[1] for t in tests])
        out.append((orjson.dumps(body), 1.0 if is_right else 0.0))
    rng.shuffle(out)
    return out


async def drive(
    http: aiohttp.ClientSession, url: str, bodies: list[tuple[bytes, float]], concurrency: int
) -> tuple[float, list[float], int, int]:
    """Send every body at `concurrency`: (seconds, latencies, reward mismatches, errors)."""
    todo = iter(bodies)
    latencies: list[float] = []
    mismatches = errors = 0

    async def client() -> None:
        nonlocal mismatches, errors
        for body, expected in todo:  # one shared iterator: each body is sent once
            start = time.perf_counter()
            try:
                async with http.post(
                    f"{url}/verify", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)
            if resp.status != 200:
                errors += 1
            elif orjson.loads(raw).get("reward") != expected:
                mismatches += 1

    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    return time.perf_counter() - start, latencies, mismatches, errors


async def sample(meter: Meter, stop: asyncio.Event) -> None:
    """Sample the way until `stop` (in a thread: it reads /proc)."""
    while not stop.is_set():
        await asyncio.to_thread(meter.sample)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)


async def metered(way: Way, work: Awaitable[T]) -> tuple[T, Usage]:
    """`work`'s result, and what the way used while it ran."""
    meter = Meter(way.snapshot, way.pid)
    await asyncio.to_thread(meter.begin)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(meter, stop))
    try:
        result = await work
    finally:
        stop.set()
        await sampler
    return result, await asyncio.to_thread(meter.end)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def measure(
    way: Way, http: aiohttp.ClientSession, bodies: list[tuple[bytes, float]], concurrency: int
) -> dict[str, Any]:
    """One round of one way."""
    run = drive(http, way.url, bodies, concurrency)
    (seconds, latencies, mismatches, errors), usage = await metered(way, run)
    done = max(1, len(latencies))
    return {
        "way": way.key,
        "verifies": len(bodies),
        "answered": len(latencies),
        "seconds": seconds,
        "per_second": len(latencies) / seconds,
        "p50_ms": 1000 * percentile(latencies, 0.50),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "cpu_ms": {k: 1000 * v / done for k, v in usage.cpu.items()},
        "peak_rss_mib": usage.peak_rss / 2**20,
        "peak_rss_mib_by_category": {k: v / 2**20 for k, v in usage.peak_rss_by_category.items()},
        "processes": usage.processes,
        "ray_clusters": usage.gcs_servers,
        "ray_workers_started": usage.ray_workers_started,
        "ray_workers_ended": usage.ray_workers_ended,
        "outside_session": usage.outside,
        "mismatches": mismatches,
        "errors": errors,
    }


async def idle_cpu(way: Way) -> dict[str, float]:
    """What the way costs with nothing to do: CPU percent of one core, by category."""
    # What is measured is the time passing itself.
    _, usage = await metered(way, asyncio.sleep(IDLE_SECONDS))
    return {k: 100 * v / IDLE_SECONDS for k, v in usage.cpu.items()}


def median(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    return statistics.median(row[key][sub] if sub else row[key] for row in rows)


def table(ways: list[Way], rounds: list[dict[str, Any]], idle: dict[str, dict[str, float]]) -> str:
    """Two markdown tables of medians over rounds per way, with ratios to the first way:
    throughput and correctness, then cost."""
    speed = [
        "| way | verifies/s | vs first | p50 ms | p99 ms | rewards checked | mismatches | errors |",
        "|" + "---|" * 8,
    ]
    cost = [
        "| way | CPU ms/verify | vs first | server / Ray tasks / Ray daemons | of it, the "
        "leader process | Ray workers started per round | idle CPU, % of a core "
        "| peak RSS MiB | vs first | Ray clusters |",
        "|" + "---|" * 10,
    ]
    base: tuple[float, float, float] | None = None
    for way in ways:
        rows = [r for r in rounds if r["way"] == way.key]
        rate, cpu = median(rows, "per_second"), median(rows, "cpu_ms", "total")
        rss = median(rows, "peak_rss_mib")
        base = base or (rate, cpu, rss)
        split = " / ".join(f"{median(rows, 'cpu_ms', c):.0f}" for c in CATEGORIES)
        speed.append(
            f"| {way.label} | {rate:.2f} | {rate / base[0]:.2f}x | {median(rows, 'p50_ms'):,.0f} "
            f"| {median(rows, 'p99_ms'):,.0f} | {sum(r['answered'] for r in rows):,} "
            f"| {sum(r['mismatches'] for r in rows)} | {sum(r['errors'] for r in rows)} |"
        )
        cost.append(
            f"| {way.label} | {cpu:.0f} | {cpu / base[1]:.2f}x | {split} "
            f"| {median(rows, 'cpu_ms', 'leader'):.1f} | {median(rows, 'ray_workers_started'):g} "
            f"| {idle[way.key]['total']:.1f} | {rss:,.0f} | {rss / base[2]:.2f}x "
            f"| {max(r['ray_clusters'] for r in rows)} |"
        )
    return "\n".join(speed) + "\n\n" + "\n".join(cost)


async def run(opts: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-rayv-"))
    ways = [WAYS[key](root / key) for key in opts.ways.split(",")]
    rounds: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=opts.concurrency)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        try:
            for way in ways:  # one at a time: the start-ups would share the 2 cores
                way.start()
                await way.wait_ready(http)
                # Warm-up: Ray starts its workers for the task's runtime_env on first use.
                await drive(http, way.url, verifies(4 * opts.concurrency, 0), opts.concurrency)
                print(f"  {way.label}: ready and warm", file=sys.stderr)
            idle = {way.key: await idle_cpu(way) for way in ways}
            for n in range(opts.rounds):
                bodies = verifies(opts.verifies, seed=n + 1)  # the same for every way
                for way in ways:
                    rounds.append(
                        {"round": n, **await measure(way, http, bodies, opts.concurrency)}
                    )
                    r = rounds[-1]
                    print(f"  round {n} {way.key}: {r['per_second']:.2f}/s", file=sys.stderr)
        finally:
            for way in ways:
                way.stop()
    report(opts, ways, rounds, idle, root)


def report(
    opts: argparse.Namespace,
    ways: list[Way],
    rounds: list[dict[str, Any]],
    idle: dict[str, dict[str, float]],
    root: Path,
) -> None:
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M")
    text = table(ways, rounds, idle)
    print(
        f"\n{opts.verifies} verifies at concurrency {opts.concurrency} per round, "
        f"{opts.rounds} rounds (medians), {os.cpu_count()} cores\n\n{text}"
    )
    out = REPO / "bench" / "results" / f"ray-verifier-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "date": stamp,
                "command": " ".join(sys.argv),
                "options": vars(opts),
                "ways": {way.key: way.label for way in ways},
                "rounds": rounds,
                "idle_cpu_percent": idle,
                "table": text,
                "logs": str(root),
            },
            indent=1,
        )
    )
    print(f"\nresults: {out.relative_to(REPO)}; logs: {root}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifies", type=int, default=200, help="per way per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"of {','.join(WAYS)}")
    opts = parser.parse_args()
    # A shell that starts this in the background ignores SIGINT, and its children would
    # inherit that: NeMo Gym's launcher and servers stop on SIGINT (Ctrl-C).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    asyncio.run(run(opts))


if __name__ == "__main__":
    main()
