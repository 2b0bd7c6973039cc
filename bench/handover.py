"""Episode hand-over bench: draining a worker that runs long `/run` episodes.

    python bench/handover.py [--episodes 10 100 400] [--steps 60] [--pause 0.05]

For each count: gym-proxy with 2 workers and the test app (`tests.apps`, whose `/run`
is an episode of `--steps` steps of `--pause` s, each ending at a boundary), that many
episodes started (about half on each worker), and once all run, two ways to take the
episodes off worker 0, in the same run:

- **hand-over**: `workers/drain` of slot 0; each episode parks at its next boundary and
  its request is answered by worker 1. Times the call, and compares each moved episode's
  whole duration with the episodes that stayed where they were (the added wait);
- **checkpoint** (the baseline: what an operator had before): prepare, commit and
  resume of the whole server with the same episodes running (a restore onto fresh
  workers would come on top).

Every episode's answer is checked: its log names each step once. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import CONTROL, control, wait_up  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
AUTH = {"Authorization": f"Bearer {CONTROL}"}
WORKERS = "/ng-control/v1/gym-proxy/workers"
STATUS = "/ng-control/v1/checkpoint/status"


def start(runtime: str) -> tuple[subprocess.Popen[bytes], str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log = open(Path(runtime) / "proxy.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_proxy", "tests.apps:create_app", "--workers", "2",
         "--fd", str(listener.fileno()), "--runtime-dir", runtime, "--secret", "bench",
         "--control-token", CONTROL, "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()],
    )  # fmt: skip
    listener.close()
    return proc, f"http://127.0.0.1:{port}"


async def in_flight(http: aiohttp.ClientSession, url: str) -> list[int]:
    async with http.get(f"{url}{STATUS}", headers=AUTH) as resp:
        return [w["in_flight"] for w in (await resp.json())["workers"]]


async def one_run(http: aiohttp.ClientSession, episodes: int, opts: argparse.Namespace) -> dict:
    runtime = tempfile.mkdtemp(prefix="gph-", dir="/tmp")
    proc, url = start(runtime)
    try:
        await wait_up(http, url)

        async def episode(i: int) -> tuple[float, dict[str, Any]]:
            body = {"_ng_rollout_id": f"e{i}", "steps": opts.steps, "pause": opts.pause}
            began = time.perf_counter()
            async with http.post(f"{url}/run", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise SystemExit(f"episode {i}: {resp.status} {answer}")
            return time.perf_counter() - began, answer

        runs = [asyncio.ensure_future(episode(i)) for i in range(episodes)]
        deadline = time.monotonic() + 60
        while sum(await in_flight(http, url)) < episodes:
            if time.monotonic() > deadline:
                raise SystemExit("the episodes did not all start")
            await asyncio.sleep(0.02)
        checkpoint = await control(http, url, "prepare", checkpoint_id="h1")
        checkpoint += await control(
            http, url, "commit", checkpoint_id="h1", checkpoint_dir=f"{runtime}/checkpoint"
        )
        checkpoint += await control(http, url, "resume", checkpoint_id="h1")
        on_zero = (await in_flight(http, url))[0]
        began = time.perf_counter()
        async with http.post(
            f"{url}{WORKERS}/drain", json={"slot": 0, "timeout_s": 60}, headers=AUTH
        ) as resp:
            reply = await resp.json()
        drain = time.perf_counter() - began
        if resp.status != 200 or reply["episodes_failed"]:
            raise SystemExit(f"drain failed: {resp.status} {str(reply)[:400]}")
        results = await asyncio.gather(*runs)
        moved, stayed = [], []
        for i, (seconds, answer) in enumerate(results):
            if answer["state"]["log"] != [f"e{i}:{s}" for s in range(opts.steps)]:
                raise SystemExit(f"episode {i}: steps not each done once: {answer['state']}")
            (moved if answer["restored"] else stayed).append(seconds)
        if len(moved) != reply["episodes_moved"]:
            raise SystemExit(f"{len(moved)} answers restored, drain said {reply['episodes_moved']}")
        return {
            "on_zero": on_zero,
            "moved": len(moved),
            "drain": drain,
            "checkpoint": checkpoint,
            "added": statistics.median(moved) - statistics.median(stayed) if stayed else None,
        }
    finally:
        proc.terminate()
        proc.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[10, 100, 400])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pause", type=float, default=0.05)
    opts = parser.parse_args()
    rows = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        for episodes in opts.episodes:
            rows.append((episodes, await one_run(http, episodes, opts)))
    print(f"gym-proxy hand-over bench: /run episodes of {opts.steps} steps of {opts.pause} s on")
    print("2 workers; worker 0 drained (its episodes handed over at their next boundary);")
    print("baseline: a checkpoint of the whole server (prepare + commit + resume), same run;")
    print("every answer checked: each step done once")
    print()
    columns = ["episodes", "on worker 0", "handed over", "drain s", "ms per episode"]
    columns += ["checkpoint s", "drain / checkpoint", "added wait per moved episode ms"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for episodes, r in rows:
        added = "-" if r["added"] is None else f"{r['added'] * 1000:.0f}"
        print(
            f"| {episodes} | {r['on_zero']} | {r['moved']} | {r['drain']:.3f} | "
            f"{r['drain'] * 1000 / max(1, r['moved']):.2f} | {r['checkpoint']:.3f} | "
            f"{r['drain'] / r['checkpoint']:.2f} | {added} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
