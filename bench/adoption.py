"""When gym-proxy dies: from the kill to serving again, its workers adopted.

    python bench/adoption.py [--sessions 1000 10000] [--workers 4] [--placement local ray]

gym-proxy with the routing bench's counter (`asgi_counter.py`), `--workers 4` and
`--orphan-grace`, holding `--sessions` sessions (each incremented once). gym-proxy alone
is killed (SIGKILL) and the same command started again at once. Per size: the seconds
from the kill to the first old session answered right, and to every session answered
right (one more increment each, 32 at a time: every count exact), beside the baseline
in the same run, a cold start of the same command (no workers to adopt, every session
lost): its seconds from start to serving. And whether the workers are the same
processes. Then, per size, a planned upgrade: the same command with `--take-over` under
8 pooled clients that never retry (failed requests, p99 before and during, the seconds
to the old process's exit, every count checked). Raw results go to
bench/results/adoption-<date>.json.

`--placement local ray` (Ray installed: the NeMo Gym tier's venv) measures the adoption
again with the workers placed on a two-node Ray cluster started on this host
(`tests/ray_nodes.py`), gym-proxy's driver on the head: the same command found the
workers' actors by name and dialed each worker's channel through its gate. Whether the
workers are the same processes is read from `status` (each worker's pid) before the kill
and after, for both placements.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from servers import HERE, REPO, free_port

sys.path.insert(0, str(REPO))

RESULTS = HERE / "results"
TOKEN = "x-nemo-gym-session-token"
CONTROL = "bench-control"


class Server:
    """The same gym-proxy command, started again as often as asked."""

    def __init__(
        self, workers: int, runtime: str, port: int, placed: dict[str, str] | None = None
    ) -> None:
        """`placed`: the environment that names a Ray cluster to place the workers on."""
        self.command = [
            sys.executable, "-m", "gym_proxy", "asgi_counter:app", "--app-dir", str(HERE),
            "--workers", str(workers), "--port", str(port), "--runtime-dir", runtime,
            "--log-level", "warning", "--secret", "bench", "--orphan-grace", "60",
            "--control-token", CONTROL,
        ]  # fmt: skip
        if placed is not None:
            self.command += ["--worker-placement", "ray", "--worker-cpus", "0.1"]
        self.env = {**os.environ, **(placed or {})}
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(runtime) / "proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command, cwd=REPO, stdout=out, stderr=out, env=self.env
            )
        return time.monotonic()

    def kill(self) -> float:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return time.monotonic()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


async def call(http: aiohttp.ClientSession, url: str, token: str | None) -> tuple[str, int]:
    headers = {TOKEN: token} if token else {}
    async with http.post(f"{url}/increment_counter", data=b"{}", headers=headers) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
        return resp.headers.get(TOKEN, token or ""), (await resp.json())["count"]


async def until_answered(url: str, token: str | None, within: float = 120) -> None:
    """Until a call answers 200 (connections refused while nothing listens)."""
    deadline = time.monotonic() + within
    while True:
        try:
            async with aiohttp.ClientSession() as http:
                await call(http, url, token)
                return
        except (aiohttp.ClientError, OSError):
            if time.monotonic() > deadline:
                raise SystemExit(f"nothing answered at {url}") from None
            await asyncio.sleep(0.01)


async def each(url: str, tokens: list[str | None], expected: int) -> list[str]:
    """One increment per token, 32 at a time; every count must be `expected`."""
    out: list[str] = []
    connector = aiohttp.TCPConnector(limit=32)
    async with aiohttp.ClientSession(connector=connector) as http:
        for start in range(0, len(tokens), 256):
            batch = tokens[start : start + 256]
            answers = await asyncio.gather(*(call(http, url, t) for t in batch))
            for token, count in answers:
                assert count == expected, f"a session counted {count}, not {expected}"
                out.append(token)
    return out


async def worker_pids(url: str) -> list[int]:
    """Each worker's pid, as `status` says it (a placed worker's is of its node)."""
    headers = {"Authorization": f"Bearer {CONTROL}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/ng-control/v1/checkpoint/status", headers=headers) as reply:
            return sorted(w["pid"] for w in (await reply.json())["workers"])


async def measure(
    sessions: int, workers: int, placed: dict[str, str] | None = None
) -> dict[str, object]:
    runtime = tempfile.mkdtemp(prefix="gpa-", dir="/tmp")
    server = Server(workers, runtime, free_port(), placed)
    try:
        started = server.start()
        await until_answered(server.url, None)
        cold = time.monotonic() - started
        tokens = await each(server.url, [None] * sessions, 1)
        pids = await worker_pids(server.url)
        killed = server.kill()
        server.start()
        await until_answered(server.url, tokens[0])
        first = time.monotonic() - killed
        await each(server.url, tokens[1:], 2)
        every = time.monotonic() - killed
        same = await worker_pids(server.url) == pids
        return {"placement": "ray" if placed else "local", "sessions": sessions,
                "cold_start_s": cold, "first_s": first, "all_s": every,
                "same_workers": same}  # fmt: skip
    finally:
        server.stop()


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else 0.0


async def upgrade(sessions: int, workers: int, clients: int = 8) -> dict[str, object]:
    """A take-over (`--take-over`) under load: `clients` pooled clients that never retry
    increment random sessions; the requests that failed, p99 latency in the 2 s before
    and from the start of the new process to 1 s after the old one's exit, the seconds
    to that exit, and every count checked after."""
    runtime = tempfile.mkdtemp(prefix="gpa-", dir="/tmp")
    server = Server(workers, runtime, free_port())
    try:
        server.start()
        await until_answered(server.url, None)
        tokens = await each(server.url, [None] * sessions, 1)
        sent = dict.fromkeys(tokens, 1)
        done: list[tuple[float, float]] = []  # (end time, latency)
        failed = 0
        stop = asyncio.Event()

        async def client(seed: int) -> None:
            nonlocal failed
            rng = random.Random(seed)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as http:
                while not stop.is_set():
                    token = tokens[rng.randrange(len(tokens))]
                    began = time.monotonic()
                    try:
                        await call(http, server.url, token)
                    except (aiohttp.ClientError, OSError):
                        failed += 1
                        continue
                    sent[token] += 1
                    ended = time.monotonic()
                    done.append((ended, ended - began))

        load = [asyncio.ensure_future(client(n)) for n in range(clients)]
        await asyncio.sleep(2.0)  # the steady window the p99 compares with (a measurement)
        old, began = server.proc, time.monotonic()
        assert old is not None
        pids = await worker_pids(server.url)
        server.command.append("--take-over")
        server.start()
        await asyncio.to_thread(old.wait)
        exited = time.monotonic()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*load)
        steady = [lat for end, lat in done if began - 2.0 <= end < began]
        during = [lat for end, lat in done if began <= end < exited + 1.0]
        assert server.proc is not None
        counts = await each_count(server.url, tokens)
        return {
            "sessions": sessions, "requests": len(done), "failed": failed,
            "old_exit_s": exited - began, "p99_steady_ms": 1000 * p99(steady),
            "p99_during_ms": 1000 * p99(during), "exact": counts == [sent[t] + 1 for t in tokens],
            "same_workers": await worker_pids(server.url) == pids,
            "old_exit_code": old.returncode,
        }  # fmt: skip
    finally:
        server.stop()


async def each_count(url: str, tokens: list[str]) -> list[int]:
    """Every session's count after one more increment (32 at a time)."""
    counts: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as http:
        for start in range(0, len(tokens), 256):
            answers = await asyncio.gather(
                *(call(http, url, t) for t in tokens[start : start + 256])
            )
            counts.extend(count for _, count in answers)
    return counts


async def adoptions(opts: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    if "local" in opts.placement:
        rows += [await measure(n, opts.workers) for n in opts.sessions]
    if "ray" in opts.placement:
        from tests.ray_nodes import RayNodes

        nodes = RayNodes(Path(tempfile.mkdtemp(prefix="gar-", dir="/tmp")))
        try:
            head, second = nodes.start_head(), nodes.add_node()
            nodes.wait_started(head, 120)
            nodes.wait_started(second, 120)
            placed = {**nodes.environment, "RAY_ADDRESS": nodes.address}
            rows += [await measure(n, opts.workers, placed) for n in opts.sessions]
        finally:
            nodes.stop()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--placement", nargs="+", choices=("local", "ray"), default=["local"])
    opts = parser.parse_args()
    rows = await adoptions(opts)
    local = {r["sessions"]: r for r in rows if r["placement"] == "local"}
    print(f"\n{opts.workers} workers, {os.cpu_count()} cores\n")
    print("| placement | sessions | cold start to serving s | kill to first session served s "
          "| vs cold start | kill to every session served s | vs local | same worker "
          "processes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = local.get(r["sessions"])
        ratio = f"{float(r['all_s']) / float(base['all_s']):.2f}x" if base else "-"  # type: ignore[arg-type]
        print(
            f"| {r['placement']} | {r['sessions']:,} | {r['cold_start_s']:.2f} "
            f"| {r['first_s']:.2f} "
            f"| {float(r['first_s']) / float(r['cold_start_s']):.2f}x | {r['all_s']:.2f} "  # type: ignore[arg-type]
            f"| {ratio} | {'yes' if r['same_workers'] else 'no'} |"
        )
    if "local" not in opts.placement:
        return
    upgrades = [await upgrade(n, opts.workers) for n in opts.sessions]
    print("\nA take-over (`--take-over`) under 8 pooled clients that never retry:\n")
    print("| sessions | requests | failed | new process start to old exit s | p99 steady ms "
          "| p99 during ms | counts exact | same workers | old exit status |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for u in upgrades:
        print(
            f"| {u['sessions']:,} | {u['requests']:,} | {u['failed']} | {u['old_exit_s']:.2f} "
            f"| {u['p99_steady_ms']:.1f} | {u['p99_during_ms']:.1f} "
            f"| {'yes' if u['exact'] else 'NO'} | {'yes' if u['same_workers'] else 'no'} "
            f"| {u['old_exit_code']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    raw = {"adoption": rows, "take_over": upgrades}
    (RESULTS / f"adoption-{stamp}.json").write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    asyncio.run(main())
