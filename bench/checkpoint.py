"""Checkpoint benchmark: prepare, commit, crash, restore and resume of many sessions.

    python bench/checkpoint.py [--sessions 10000] [--workers 2] [--restore-workers 3]

Starts gym-proxy with the counter app and a control token, seeds `--sessions` counter
sessions (each one POST), then times every control call of a checkpoint, kills every
process, starts a fresh gym-proxy with `--restore-workers`, times restore and resume, and
checks a sample of the restored counters. Prints one table of phase times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
CONTROL = "bench-control"


def start(workers: int, runtime: str) -> tuple[subprocess.Popen[bytes], str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log = open(Path(runtime) / f"proxy-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_proxy", "--workers", str(workers), "--fd",
         str(listener.fileno()), "--runtime-dir", runtime, "--secret", "bench",
         "--control-token", CONTROL, "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()],
    )  # fmt: skip
    listener.close()
    return proc, f"http://127.0.0.1:{port}"


async def wait_up(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            async with http.get(
                f"{url}/ng-control/v1/checkpoint/status",
                headers={"Authorization": f"Bearer {CONTROL}"},
            ) as resp:
                status = await resp.json() if resp.status == 200 else None
                if status and len(status["workers"]) == status["expected_workers"]:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise SystemExit("gym-proxy did not start")


async def control(http: aiohttp.ClientSession, url: str, op: str, **body: object) -> float:
    body.setdefault("deadline_ts", time.time() + 120)
    started = time.perf_counter()
    async with http.post(
        f"{url}/ng-control/v1/checkpoint/{op}",
        json=body,
        headers={"Authorization": f"Bearer {CONTROL}"},
    ) as resp:
        reply = await resp.json()
        if resp.status != 200:
            raise SystemExit(f"{op} failed: {resp.status} {reply}")
    return time.perf_counter() - started


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    for pid in [proc.pid, *map(int, children)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--restore-workers", type=int, default=3)
    opts = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="gpc-", dir="/tmp")
    checkpoint_dir = Path(runtime) / "checkpoint"
    timings: list[tuple[str, float]] = []
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        proc, url = start(opts.workers, runtime)
        await wait_up(http, url)
        tokens: list[tuple[str, int]] = []

        async def seed(i: int) -> None:
            async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
                tokens.append((resp.headers[TOKEN_HEADER], i))

        started = time.perf_counter()
        await asyncio.gather(*(seed(i) for i in range(opts.sessions)))
        timings.append((f"seed {opts.sessions} sessions (HTTP)", time.perf_counter() - started))
        timings.append(("prepare", await control(http, url, "prepare", checkpoint_id="b1")))
        timings.append(
            (
                "commit",
                await control(
                    http, url, "commit", checkpoint_id="b1", checkpoint_dir=str(checkpoint_dir)
                ),
            )
        )
        timings.append(("resume", await control(http, url, "resume", checkpoint_id="b1")))
        kill_tree(proc)
        proc, url = start(opts.restore_workers, runtime)
        await wait_up(http, url)
        timings.append(
            (
                "restore",
                await control(
                    http,
                    url,
                    "restore",
                    checkpoint_id="b2",
                    checkpoint_dir=str(checkpoint_dir),
                    episode_ids=[],
                ),
            )
        )
        timings.append(
            ("resume after restore", await control(http, url, "resume", checkpoint_id="b2"))
        )
        for token, count in random.Random(0).sample(tokens, min(200, len(tokens))):
            async with http.post(f"{url}/get_counter_value", headers={TOKEN_HEADER: token}) as resp:
                assert (await resp.json())["count"] == count
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    size = sum(p.stat().st_size for p in checkpoint_dir.rglob("records-*.jsonl"))
    print(
        f"gym-proxy checkpoint bench: {opts.sessions} counter sessions, "
        f"{opts.workers} workers -> crash -> {opts.restore_workers} workers, "
        f"records file {size / 1e6:.2f} MB, 200 restored counters checked"
    )
    print("| phase | seconds | us per session |")
    print("|---|---|---|")
    for name, seconds in timings:
        print(f"| {name} | {seconds:.3f} | {seconds * 1e6 / opts.sessions:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
