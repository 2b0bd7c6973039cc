"""Routing benchmark: gym-proxy vs. straight to the workers, in one run.

    python bench/routing.py [--seconds 5] [--workers 2] [--concurrency 1 64 256]

For each app kind (the aiohttp counter, `worker.counter`, and the counter as a bare ASGI
app, `bench/asgi_counter.py`, on uvicorn workers) it starts `gym-proxy --workers 2`, then
for each concurrency runs the load generator (its own process) (a) through the proxy,
every connection on its own session, (b) straight to the workers' Unix sockets (the same
workers, participant runtime included), connections split evenly. Then (c) the same ASGI
counter under `uvicorn --workers 2` on one shared port: the setup gym-proxy replaces,
which cannot keep a session on one worker. Prints requests/s, p50/p99 latency, the
proxy's CPU microseconds per request (from /proc/PID/stat, warm-up included in both CPU
and request counts) and ratios to direct-to-workers of the same app.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


APPS = {
    # name -> gym-proxy APP arguments
    "aiohttp counter": ["worker.counter:create_app"],
    "ASGI counter": ["asgi_counter:app", "--app-dir", str(HERE)],
}


def start_proxy(
    workers: int, runtime_parent: str, app: list[str]
) -> tuple[subprocess.Popen[bytes], int, Path]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log = Path(runtime_parent) / "proxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                *app,
                "--workers",
                str(workers),
                "--fd",
                str(listener.fileno()),
                "--runtime-dir",
                runtime_parent,
                "--log-level",
                "warning",
                "--secret",
                "bench",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=[listener.fileno()],
        )
    listener.close()
    deadline = time.monotonic() + 30
    while True:
        sockets = sorted(Path(runtime_parent).glob("gym-proxy-*/w*.sock"))
        if len(sockets) == workers and _answers(port, b"POST /increment_counter"):
            return proc, port, sockets[0].parent
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gym-proxy did not start:\n{log.read_text()}")
        time.sleep(0.05)


def _answers(port: int, line: bytes = b"GET /get_counter_value") -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(
                line + b" HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return conn.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def start_uvicorn(workers: int) -> tuple[subprocess.Popen[bytes], int] | None:
    """`uvicorn --workers N` on a free loopback port, or None if uvicorn is missing."""
    if importlib.util.find_spec("uvicorn") is None:
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "asgi_counter:app", "--app-dir", str(HERE),
         "--workers", str(workers), "--port", str(port), "--loop", "uvloop",
         "--http", "httptools", "--no-access-log", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not _answers(port, b"POST /increment_counter"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("uvicorn did not start")
        time.sleep(0.05)
    return proc, port


def load(args: list[str], seconds: float, connections: int) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            *args,
            "--connections",
            str(connections),
            "--seconds",
            str(seconds),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return orjson.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    opts = parser.parse_args()
    rows: list[tuple[int, str, dict[str, float]]] = []
    for app_name, app in APPS.items():
        runtime_parent = tempfile.mkdtemp(prefix="gpb-", dir="/tmp")
        proc, port, runtime = start_proxy(opts.workers, runtime_parent, app)
        sockets = sorted(str(p) for p in runtime.glob("w*.sock"))
        try:
            for conc in opts.concurrency:
                before = cpu_seconds(proc.pid)
                via = load(["--tcp", f"127.0.0.1:{port}"], opts.seconds, conc)
                via["cpu_us"] = (cpu_seconds(proc.pid) - before) * 1e6 / max(1, via["total"])
                direct_args = ["--direct"] + [a for s in sockets for a in ("--unix", s)]
                rows.append((conc, f"gym-proxy, {app_name}", via))
                direct = load(direct_args, opts.seconds, conc)
                rows.append((conc, f"direct to workers, {app_name}", direct))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    uvicorn = start_uvicorn(opts.workers)
    if uvicorn is not None:
        try:
            for conc in opts.concurrency:
                args = ["--direct", "--tcp", f"127.0.0.1:{uvicorn[1]}"]
                rows.append(
                    (conc, "uvicorn shared port, ASGI counter", load(args, opts.seconds, conc))
                )
        finally:
            uvicorn[0].send_signal(signal.SIGTERM)
            uvicorn[0].wait(30)
    print(
        f"gym-proxy routing bench: {opts.workers} workers, counter app, "
        f"POST /increment_counter, {opts.seconds:g} s per run, {os.cpu_count()} cores"
    )
    if uvicorn is None:
        print("(uvicorn is not installed: pip install -e '.[bench]' adds the shared-port rows)")
    print(
        "| conns | front end | req/s | vs direct | p50 ms | p99 ms | front-end CPU us/req "
        "| errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    direct_rate = {
        (c, name.split(", ")[1]): r["requests"] / r["seconds"]
        for c, name, r in rows
        if name.startswith("direct")
    }
    for conc, name, result in sorted(rows, key=lambda row: row[0]):
        rate = result["requests"] / result["seconds"]
        base = direct_rate[conc, name.split(", ")[1]]
        cpu = f"{result['cpu_us']:.0f}" if "cpu_us" in result else "-"
        print(
            f"| {conc} | {name} | {rate:,.0f} | {rate / base:.2f} "
            f"| {result['p50_ms']:.2f} | {result['p99_ms']:.2f} | {cpu} | {result['errors']} |"
        )


if __name__ == "__main__":
    main()
