"""Routing benchmark: gym-proxy vs. straight to the workers, in one run.

    python bench/routing.py [--seconds 5] [--workers 2] [--concurrency 1 64 256]

Starts `gym-proxy --workers 2` with the counter app, then for each concurrency runs the
load generator (its own process) (a) through the proxy, every connection on its own
session, and (b) straight to the workers' Unix sockets, connections split evenly. Prints
requests/s, p50/p99 latency, the proxy's CPU microseconds per request (from
/proc/PID/stat, warm-up included in both CPU and request counts) and proxy/direct ratios.
"""

from __future__ import annotations

import argparse
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


def start_proxy(workers: int, runtime_parent: str) -> tuple[subprocess.Popen[bytes], int, Path]:
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
        if len(sockets) == workers and _answers(port):
            return proc, port, sockets[0].parent
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gym-proxy did not start:\n{log.read_text()}")
        time.sleep(0.05)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"GET /get_counter_value HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            return conn.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


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
    runtime_parent = tempfile.mkdtemp(prefix="gpb-", dir="/tmp")
    proc, port, runtime = start_proxy(opts.workers, runtime_parent)
    sockets = sorted(str(p) for p in runtime.glob("w*.sock"))
    rows = []
    try:
        for conc in opts.concurrency:
            before = cpu_seconds(proc.pid)
            via = load(["--tcp", f"127.0.0.1:{port}"], opts.seconds, conc)
            cpu = cpu_seconds(proc.pid) - before
            direct_args = ["--direct"] + [a for s in sockets for a in ("--unix", s)]
            direct = load(direct_args, opts.seconds, conc)
            rows.append((conc, via, direct, cpu * 1e6 / max(1, via["total"])))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(
        f"gym-proxy routing bench: {opts.workers} workers, counter app, "
        f"POST /increment_counter, {opts.seconds:g} s per run, {os.cpu_count()} cores"
    )
    header = (
        "| conns | proxy req/s | direct req/s | ratio | proxy p50 ms | direct p50 ms "
        "| proxy p99 ms | direct p99 ms | proxy CPU us/req | errors |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for conc, via, direct, cpu_us in rows:
        rate_via = via["requests"] / via["seconds"]
        rate_direct = direct["requests"] / direct["seconds"]
        print(
            f"| {conc} | {rate_via:,.0f} | {rate_direct:,.0f} | {rate_via / rate_direct:.2f} "
            f"| {via['p50_ms']:.2f} | {direct['p50_ms']:.2f} | {via['p99_ms']:.2f} "
            f"| {direct['p99_ms']:.2f} | {cpu_us:.0f} | {via['errors'] + direct['errors']} |"
        )


if __name__ == "__main__":
    main()
