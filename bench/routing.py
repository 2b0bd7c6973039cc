"""Routing bench: gym-proxy against the alternatives, in one run, as ratios.

    python bench/routing.py [--seconds 5] [--workers 2 4] [--connections 1 64 256 1024]
                            [--pairs N]

Every front end serves the same app (the ASGI counter) and gets the same load: the
load generator (`bench/loadgen.py`, its own process) keeps C keep-alive connections
busy, drawing each request's session from one shared pool (sessions = max(C, 512)),
so a session's calls arrive on any connection, as from NeMo Gym's clients.

- **gym-proxy**: the proxy with N workers;
- **direct**: the same workers over their Unix sockets, each connection carrying
  sessions its worker holds (the limit: nothing routes);
- **haproxy**: HAProxy 1 thread, cookie stickiness, to the same worker sockets (skipped
  with a note when `haproxy` is not installed: `apt-get install haproxy`);
- **port-sharing**: `uvicorn --workers N` on one port with an in-worker router that
  forwards a request to its session's worker over a Unix socket ((N-1)/N of them).

Per cell: requests/s, ratio to direct, p50/p99/p99.9 latency, errors, the front end's
CPU per request (its own process: gym-proxy, haproxy; split into user and system time in
the summary) and the whole server's (front end plus workers). With `--pairs N`, then N
back-to-back pairs of gym-proxy and HAProxy cells per connection count, and the median
of their front-end CPU ratios: one cell of each can land in different moments of a
shared machine (the ratio moved by 0.3x between runs ten minutes apart). With wrk
installed (`apt-get install wrk`), gym-proxy, HAProxy and port-sharing are also loaded
with wrk (less client CPU than the Python generator; its script rotates the sessions over
the connections too) for the same ratios.
Then: the proxy's memory with 10,000 idle keep-alive connections, and SSE throughput
through the proxy vs direct. Raw results go to bench/results/routing-<date>.json, and
plots (matplotlib, the `bench` extra) of req/s and p99 vs connections next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from servers import (
    REPO,
    FrontEnd,
    GymProxy,
    HAProxy,
    PortSharing,
    cpu_seconds,
    cpu_split,
    rss_mib,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ORDER = ("gym-proxy", "direct", "haproxy", "port-sharing")


def load(plan: str, seconds: float, connections: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(HERE / "loadgen.py"), plan, "--connections", str(connections),
         "--seconds", str(seconds)],
        check=True, capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    return orjson.loads(out.stdout.strip().splitlines()[-1])


def measure(front: FrontEnd, plan: str, seconds: float, connections: int) -> dict[str, Any]:
    """One cell: load `front` and charge CPU to its processes (the front end's also
    split into user and system time: the kernel's part is what any proxy pays)."""
    before = {pid: cpu_split(pid) for pid in front.server_pids}
    result = load(plan, seconds, connections)
    split = {}
    for pid, (user, system) in before.items():
        user_now, system_now = cpu_split(pid)
        split[pid] = (user_now - user, system_now - system)
    used = {pid: sum(times) for pid, times in split.items()}
    total = max(1, result["total"])  # CPU covers the warm-up too, and so does this count
    result["rps"] = result["requests"] / result["seconds"]
    result["front_cpu_us"] = (
        sum(used[p] for p in front.front_pids) * 1e6 / total if front.front_pids else None
    )
    if front.front_pids:
        result["front_user_us"] = sum(split[p][0] for p in front.front_pids) * 1e6 / total
        result["front_sys_us"] = sum(split[p][1] for p in front.front_pids) * 1e6 / total
    result["server_cpu_us"] = sum(used.values()) * 1e6 / total
    return result


WRK_SCRIPT = """
local sessions = {%s}
local i = 0
request = function()
  i = i + 1
  local headers = {["Content-Type"] = "application/json"}
  for name, value in pairs(sessions[(i %% #sessions) + 1]) do headers[name] = value end
  return wrk.format("POST", "/increment_counter", headers, '{"count": 1}')
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %%d, "seconds": %%f, "errors": %%d, ' ..
    '"p50_ms": %%f, "p99_ms": %%f, "p999_ms": %%f}\\n',
    summary.requests, summary.duration / 1e6, e.connect + e.read + e.write + e.timeout + e.status,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency:percentile(99.9) / 1000))
end
"""


def wrk_measure(front: FrontEnd, seconds: float, connections: int, directory: str) -> dict:
    """The same cell loaded by wrk (TCP front ends only)."""
    entries = []
    for _, lines in front.sessions:
        pairs = [line.split(": ", 1) for line in lines.strip().split("\r\n")]
        entries.append("{" + ", ".join(f'["{k}"] = "{v}"' for k, v in pairs) + "}")
    script = Path(directory) / f"{front.name}.lua"
    script.write_text(WRK_SCRIPT % ", ".join(entries))
    before = {pid: cpu_seconds(pid) for pid in front.server_pids}
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
         f"http://{front.targets[0]['tcp']}/increment_counter"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    used = {pid: cpu_seconds(pid) - start for pid, start in before.items()}
    result = orjson.loads(out.stdout.strip().splitlines()[-1])
    requests = max(1, result["requests"])
    result["rps"] = result["requests"] / result["seconds"]
    front_cpu = sum(used[p] for p in front.front_pids) * 1e6 / requests
    result["front_cpu_us"] = front_cpu if front.front_pids else None
    result["server_cpu_us"] = sum(used.values()) * 1e6 / requests
    return result


def data_path_mode() -> str:
    """What the proxy processes of this run import: the mypyc build or the source."""
    probe = "import gym_proxy.proxy.data_path as d; print(*d.mode(), sep=': ')"
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def run_workers(workers: int, opts: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """Every front end at every connection count, for `workers` workers."""
    sessions = max(512, max(opts.connections))
    directory = tempfile.mkdtemp(prefix="gpr-", dir="/tmp")
    proxy = GymProxy(workers)
    haproxy = sharing = None
    fronts = [proxy.front_end(sessions), proxy.direct(sessions)]
    try:
        if HAProxy.installed():
            haproxy = HAProxy(proxy.sockets(), proxy.workers(), max(opts.connections))
            fronts.append(haproxy.front_end(sessions))
        elif workers == opts.workers[0]:
            notes.append("haproxy is not installed (apt-get install haproxy): rows skipped")
        sharing = PortSharing(workers)
        fronts.append(sharing.front_end(sessions))
        plans = {front.name: front.plan(directory) for front in fronts}
        cells: dict[str, Any] = {}
        for connections in opts.connections:
            for front in fronts:
                cell = measure(front, plans[front.name], opts.seconds, connections)
                cells.setdefault(front.name, {})[str(connections)] = cell
                print(f"  {workers} workers, {connections:>4} conns, {front.name:<12} "
                      f"{cell['rps']:>9,.0f} req/s", file=sys.stderr)  # fmt: skip
        pairs: dict[str, list[float]] = {}
        if haproxy is not None and opts.pairs:
            pairs = alternate(fronts[0], fronts[2], plans, opts)
        wrk: dict[str, Any] = {}
        if shutil.which("wrk") and haproxy is not None:
            for connections in (c for c in opts.connections if c >= 64):
                for front in (fronts[0], fronts[2], fronts[3]):
                    cell = wrk_measure(front, opts.seconds, connections, directory)
                    wrk.setdefault(front.name, {})[str(connections)] = cell
        elif workers == opts.workers[0]:
            notes.append("wrk is not installed (apt-get install wrk): wrk rows skipped")
        return {"cells": cells, "wrk": wrk, "sessions": sessions, "pairs": pairs}
    finally:
        for server in (sharing, haproxy, proxy):
            if server is not None:
                server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def alternate(
    gym_proxy: FrontEnd, haproxy: FrontEnd, plans: dict[str, str], opts: argparse.Namespace
) -> dict[str, list[float]]:
    """gym-proxy's front-end CPU per request over HAProxy's, in `--pairs` back-to-back
    pairs of cells per connection count: a pair shares the machine's state of the
    moment, which one cell of each an hour apart does not."""
    ratios: dict[str, list[float]] = {}
    for connections in opts.connections:
        for _ in range(opts.pairs):
            ours = measure(gym_proxy, plans[gym_proxy.name], opts.seconds, connections)
            theirs = measure(haproxy, plans[haproxy.name], opts.seconds, connections)
            ratio = ours["front_cpu_us"] / theirs["front_cpu_us"]
            ratios.setdefault(str(connections), []).append(ratio)
            print(f"  pair at {connections:>4} conns: {ratio:.2f}x", file=sys.stderr)
    return ratios


async def idle_memory(count: int) -> dict[str, float]:
    """gym-proxy's RSS with `count` idle keep-alive connections (each made one request)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count = min(count, hard - 200)
    proxy = GymProxy(2, "--max-connections", str(count + 10))
    try:
        before = rss_mib(proxy.proc.pid)
        request = (
            b'POST /increment_counter HTTP/1.1\r\nhost: b\r\ncontent-length: 12\r\n\r\n{"count": 1}'
        )
        conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for start in range(0, count, 500):
            batch = await asyncio.gather(
                *(
                    asyncio.open_connection("127.0.0.1", proxy.port)
                    for _ in range(start, min(count, start + 500))
                )
            )
            for _, writer in batch:
                writer.write(request)
            for reader, _ in batch:
                await reader.readuntil(b'"count"')
            conns += batch
        await asyncio.sleep(1.0)  # let the proxy settle before reading its RSS
        after = rss_mib(proxy.proc.pid)
        for _, writer in conns:
            writer.close()
        return {"connections": count, "rss_before_mib": before, "rss_idle_mib": after}
    finally:
        proxy.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def sse_throughput(streams: int, events: int, size: int) -> dict[str, float]:
    """MB/s of `streams` concurrent SSE responses through gym-proxy vs direct."""
    proxy = GymProxy(2)
    request = b"GET /sse?events=%d&size=%d HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n"
    request %= (events, size)

    async def one(connect: Any) -> int:
        reader, writer = await connect()
        writer.write(request)
        received = 0
        while chunk := await reader.read(1 << 16):
            received += len(chunk)
        writer.close()
        return received

    async def rate(connect: Any) -> float:
        started = time.perf_counter()
        total = sum(await asyncio.gather(*(one(connect) for _ in range(streams))))
        return total / (time.perf_counter() - started) / 1e6

    try:
        sockets = proxy.sockets()
        via = await rate(lambda: asyncio.open_connection("127.0.0.1", proxy.port))
        direct = await rate(lambda: asyncio.open_unix_connection(sockets[0]))
        return {"streams": streams, "events": events, "event_bytes": size,
                "proxy_mb_s": via, "direct_mb_s": direct}  # fmt: skip
    finally:
        proxy.stop()


def table(workers: int, run: dict[str, Any], connections: list[int]) -> list[str]:
    cells = run["cells"]
    lines = [
        f"\n{workers} workers ({run['sessions']} sessions, shared keep-alive pool)\n",
        "| conns | front end | req/s | vs direct | p50 ms | p99 ms | p99.9 ms | errors "
        "| front-end CPU us/req | server CPU us/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in connections:
        base = cells["direct"][str(c)]["rps"]
        for name in ORDER:
            cell = cells.get(name, {}).get(str(c))
            if cell is None:
                continue
            front = cell["front_cpu_us"]
            lines.append(
                f"| {c} | {name} | {cell['rps']:,.0f} | {cell['rps'] / base:.2f} "
                f"| {cell['p50_ms']:.2f} | {cell['p99_ms']:.2f} | {cell['p999_ms']:.2f} "
                f"| {cell['errors']} | {'-' if front is None else f'{front:.1f}'} "
                f"| {cell['server_cpu_us']:.1f} |"
            )
    return lines


def summary(workers: int, run: dict[str, Any], connections: list[int]) -> list[str]:
    """The ratios the issue's targets are stated in."""
    cells = run["cells"]
    lines = []
    for c in connections:
        gp = cells["gym-proxy"][str(c)]
        parts = [f"{workers}w {c:>4}c:"]
        if c == 1:
            added = gp["p50_ms"] - cells["direct"]["1"]["p50_ms"]
            parts.append(f"added p50 vs direct {added:+.3f} ms")
        if "port-sharing" in cells:
            ps = cells["port-sharing"][str(c)]
            parts.append(
                f"vs port-sharing {gp['rps'] / ps['rps']:.2f}x req/s, "
                f"p99 {gp['p99_ms']:.2f} vs {ps['p99_ms']:.2f} ms"
            )
        if "haproxy" in cells:
            hp = cells["haproxy"][str(c)]
            parts.append(
                f"vs haproxy {gp['rps'] / hp['rps']:.2f}x req/s, "
                f"{gp['front_cpu_us'] / hp['front_cpu_us']:.2f}x front-end CPU/req "
                f"(user {gp['front_user_us']:.1f} vs {hp['front_user_us']:.1f} us, "
                f"system {gp['front_sys_us']:.1f} vs {hp['front_sys_us']:.1f} us)"
            )
        lines.append(" ".join(parts))
    for c, ratios in run.get("pairs", {}).items():
        ordered = sorted(ratios)
        lines.append(
            f"{workers}w {int(c):>4}c: front-end CPU/req against haproxy in {len(ordered)} "
            f"back-to-back pairs: median {statistics.median(ordered):.2f}x "
            f"({', '.join(f'{r:.2f}' for r in ordered)})"
        )
    for c, gp in run["wrk"].get("gym-proxy", {}).items():
        hp = run["wrk"]["haproxy"][c]
        lines.append(
            f"{workers}w {int(c):>4}c (wrk): gym-proxy {gp['rps']:,.0f} req/s "
            f"{gp['front_cpu_us']:.1f} us/req, haproxy {hp['rps']:,.0f} req/s "
            f"{hp['front_cpu_us']:.1f} us/req: {gp['rps'] / hp['rps']:.2f}x req/s, "
            f"{gp['front_cpu_us'] / hp['front_cpu_us']:.2f}x CPU/req"
        )
        ps = run["wrk"].get("port-sharing", {}).get(c)
        if ps is not None:
            lines.append(
                f"{workers}w {int(c):>4}c (wrk): vs port-sharing {gp['rps'] / ps['rps']:.2f}x "
                f"req/s, p99 {gp['p99_ms']:.2f} vs {ps['p99_ms']:.2f} ms, server CPU/req "
                f"{gp['server_cpu_us']:.1f} vs {ps['server_cpu_us']:.1f} us"
            )
    return lines


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = results["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 8), squeeze=False)
    for col, (workers, run) in enumerate(runs.items()):
        for name in ORDER:
            cells = run["cells"].get(name)
            if not cells:
                continue
            xs = sorted(int(c) for c in cells)
            axes[0][col].plot(xs, [cells[str(x)]["rps"] for x in xs], marker="o", label=name)
            axes[1][col].plot(xs, [cells[str(x)]["p99_ms"] for x in xs], marker="o", label=name)
        axes[1][col].set_yscale("log")
        for row, label in enumerate(("requests/s", "p99 latency (ms)")):
            axes[row][col].set_xscale("log")
            axes[row][col].set_xlabel("connections")
            axes[row][col].set_ylabel(label)
            axes[row][col].set_title(f"{workers} workers")
            axes[row][col].legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--idle-connections", type=int, default=10000)
    parser.add_argument("--skip-extras", action="store_true", help="no memory or SSE runs")
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="then N back-to-back gym-proxy/HAProxy pairs per connection count (CPU ratios)",
    )
    opts = parser.parse_args()
    notes: list[str] = []
    started = datetime.datetime.now(datetime.UTC)
    results: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "seconds": opts.seconds,
        "command": " ".join(["python", "bench/routing.py", *sys.argv[1:]]),
        "data_path": data_path_mode(),
        "runs": {},
    }
    for workers in opts.workers:
        results["runs"][str(workers)] = run_workers(workers, opts, notes)
    if not opts.skip_extras:
        results["idle_memory"] = asyncio.run(idle_memory(opts.idle_connections))
        results["sse"] = asyncio.run(sse_throughput(streams=8, events=4000, size=1024))
    results["notes"] = notes
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"routing-{started:%Y-%m-%dT%H%M}"
    stem.with_suffix(".json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    plotted = plot(results, stem.with_suffix(".png"))
    print(f"gym-proxy routing bench, {started:%Y-%m-%d}, {os.cpu_count()} cores, "
          f"{opts.seconds:g} s per cell: `{results['command']}`")  # fmt: skip
    print(f"gym-proxy data path: {results['data_path']}")
    for workers, run in results["runs"].items():
        print("\n".join(table(int(workers), run, opts.connections)))
    print("\nTargets:")
    for workers, run in results["runs"].items():
        print("\n".join(summary(int(workers), run, opts.connections)))
    if "idle_memory" in results:
        mem = results["idle_memory"]
        print(f"\nIdle keep-alive: {mem['connections']:,} connections, proxy RSS "
              f"{mem['rss_before_mib']:.0f} -> {mem['rss_idle_mib']:.0f} MiB")  # fmt: skip
        sse = results["sse"]
        print(f"SSE: {sse['streams']} streams x {sse['events']} events x {sse['event_bytes']} B: "
              f"{sse['proxy_mb_s']:.0f} MB/s through gym-proxy, {sse['direct_mb_s']:.0f} MB/s "
              f"direct ({sse['proxy_mb_s'] / sse['direct_mb_s']:.2f})")  # fmt: skip
    for note in notes:
        print(f"note: {note}")
    print(
        f"\nraw: {stem.with_suffix('.json')}"
        + (f", plot: {stem.with_suffix('.png')}" if plotted else "")
    )


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    main()
