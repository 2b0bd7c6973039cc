"""The proxy's cost per request in instructions, against HAProxy's, in one run (issue 40).

    .venv/bin/python bench/instructions.py [--requests 300] [--workers 1]

Wall-clock CPU on a shared 2-core machine moves by 2x from one hour to the next;
instructions do not. Each front end runs under `valgrind --tool=callgrind` (counting off
at start: `--instr-atstart=no`), its backends natively: gym-proxy (its workers are child
processes callgrind does not follow) and HAProxy (one thread, cookie stickiness) in front
of the same gym-proxy worker sockets. For each cell of a fixed request mix, the bench
zeroes the counts, turns counting on, sends `--requests` requests one at a time from
this process, turns counting off and dumps: instructions (Ir) per request. What the
process does on its own while the requests run (gym-proxy's timers: pings, the load
sample, the loop-lag sampler) is measured alike with no request, per second, and taken
off. The mix:

- `get`: keep-alive GET of a session's counter (one connection for all);
- `post`: keep-alive POST of a small JSON body;
- `post64k`: keep-alive POST of a 64 KiB body;
- `connect`: a new connection for each request (GET).

Also each front end's system calls per request over the same mix (`strace -c`, its own
thread, in separate runs: strace and callgrind do not stack). Prints a table and writes
bench/results/instructions-<stamp>.json. Needs valgrind, strace and haproxy (Debian:
`apt-get install valgrind strace haproxy`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from servers import REPO, GymProxy, children, free_port, wait_answering

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CELLS = ("get", "post", "post64k", "connect")
IDLE_SECONDS = 3.0
UNDER_VALGRIND = 600.0  # seconds a front end may take to answer (Python boots slowly)
SESSION = "x-ng-session-id: bench-1\r\n"


def request_bytes(cell: str, host: str, extra: str) -> bytes:
    if cell in ("get", "connect"):
        head = f"GET /get_counter_value HTTP/1.1\r\nhost: {host}\r\n{extra}\r\n"
        return head.encode()
    body = b'{"count": 1}' if cell == "post" else b'{"count": 1, "pad": "' + b"x" * 65500 + b'"}'
    head = (
        f"POST /increment_counter HTTP/1.1\r\nhost: {host}\r\n{extra}"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_response(sock: socket.socket) -> None:
    """One whole response (content-length framed, as the counter answers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"not a 200: {head[:80]!r}")
    found = re.search(rb"(?i)content-length:\s*(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside the response body")
        body += chunk


def send_requests(port: int, cell: str, count: int, extra: str) -> float:
    """`count` requests of `cell`, one at a time; the seconds they took."""
    message = request_bytes(cell, f"127.0.0.1:{port}", extra)
    start = time.monotonic()
    sock = None
    try:
        for _ in range(count):
            if sock is None or cell == "connect":
                if sock is not None:
                    sock.close()
                sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.sendall(message)
            read_response(sock)
    finally:
        if sock is not None:
            sock.close()
    return time.monotonic() - start


class Callgrind:
    """A process under callgrind, counting only between `start` and `stop`."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpi-", dir="/tmp"))
        self.out = self.dir / "callgrind.out"
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=no",
            f"--callgrind-out-file={self.out}.%p", *argv,
        ]  # fmt: skip
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)

    def control(self, *args: str) -> None:
        subprocess.run(
            ["callgrind_control", *args, str(self.proc.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def counted(self, work: Any, keep: Path | None = None) -> tuple[int, float]:
        """(instructions, seconds) of the process while `work()` runs; its dump is kept
        as `keep` (for `callgrind_annotate`) when given."""
        self.control("--zero")
        self.control("--instr=on")
        seconds = work()
        self.control("--instr=off")
        for old in self.dir.glob("callgrind.out.*.*"):
            old.unlink()
        self.control("--dump")
        dump, total = _latest_dump(self.dir)
        if keep is not None:
            shutil.copyfile(dump, keep)
        return total, seconds

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _latest_dump(directory: Path) -> tuple[Path, int]:
    """The latest dump and its Ir total (callgrind writes `<out>.<pid>.<n>` per dump)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for dump in sorted(directory.glob("callgrind.out.*.*")):
            text = dump.read_text(errors="replace")
            # `totals:` sums the counted cost lines; `summary:` reads 0 when counting
            # was toggled on after the start (it is the cost at the last zeroing)
            found = re.search(r"^totals:\s*(\d+)", text, re.M)
            if found:
                return dump, int(found.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"no callgrind dump in {directory}")


def measure(
    process: Callgrind, port: int, extra: str, requests: int, keep: Path | None
) -> dict[str, float]:
    """Instructions per request of each cell, the process's own idle rate taken off;
    each cell's dump kept as `<keep><cell>.callgrind` when `keep` is given."""
    idle, idle_seconds = process.counted(lambda: time.sleep(IDLE_SECONDS) or IDLE_SECONDS)
    rate = idle / idle_seconds
    cells: dict[str, float] = {"idle_per_second": rate}
    for cell in CELLS:
        send_requests(port, cell, 20, extra)  # warm: code paths, pools, caches
        total, seconds = process.counted(
            lambda c=cell: send_requests(port, c, requests, extra),
            None if keep is None else keep.with_name(f"{keep.name}{cell}.callgrind"),
        )
        cells[cell] = max(0.0, total - rate * seconds) / requests
        cells[f"raw_{cell}"] = total
        cells[f"seconds_{cell}"] = seconds
    return cells


def syscalls(
    argv: list[str], port: int, extra: Callable[[int], str], requests: int
) -> dict[str, float]:
    """System calls per request of each cell: the front end's own (`strace -c`, its
    main thread), a run of `requests` less a run of none, both after the same start."""
    found: dict[str, float] = {}
    for cell in CELLS:
        counts = [_strace_calls(argv, port, cell, extra, n) for n in (0, requests)]
        found[cell] = (counts[1] - counts[0]) / requests
    return found


def _strace_calls(
    argv: list[str], port: int, cell: str, extra: Callable[[int], str], requests: int
) -> int:
    with tempfile.NamedTemporaryFile(suffix=".strace") as report:
        proc = subprocess.Popen(
            ["strace", "-c", "-o", report.name, *argv],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_answering(port, proc, " ".join(argv[:3]), UNDER_VALGRIND)
            send_requests(port, cell, 20 + requests, extra(port))
        finally:
            for child in children(proc.pid):  # the traced front end: strace then reports
                os.kill(child, signal.SIGTERM)
            proc.wait(60)
        lines = Path(report.name).read_text().splitlines()
    header = next(line for line in lines if "calls" in line and "syscall" in line)
    total = next(line for line in lines if line.rstrip().endswith(" total"))
    column = header.index("calls")  # right-aligned under its header
    return int(total[: column + len("calls")].split()[-1])


def haproxy_config(directory: Path, port: int, sockets: list[str]) -> Path:
    servers = "\n".join(f"  server w{i} unix@{path}" for i, path in enumerate(sockets))
    config = directory / "haproxy.cfg"
    config.write_text(
        "global\n  maxconn 1000\n  nbthread 1\n"
        "defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n"
        "  timeout server 60s\n  option http-keep-alive\n"
        f"frontend fe\n  bind 127.0.0.1:{port}\n  default_backend workers\n"
        "backend workers\n  http-reuse always\n  balance source\n"
        f"{servers}\n"
    )
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--keep", type=Path, metavar="DIR",
        help="keep each cell's callgrind dump in DIR (<front end>-<cell>.callgrind), "
        "for callgrind_annotate",
    )  # fmt: skip
    opts = parser.parse_args()
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=True)
    for tool in ("valgrind", "callgrind_control", "strace", "haproxy"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench/instructions.py needs {tool} (apt-get install {tool})")
    logs = Path(tempfile.mkdtemp(prefix="gpl-", dir="/tmp"))
    backends = GymProxy(opts.workers)  # the workers HAProxy sends to
    runtime = tempfile.mkdtemp(prefix="gpr-", dir="/tmp")
    results: dict[str, dict[str, float]] = {}
    try:
        sockets = backends.sockets()
        port = free_port()
        config = haproxy_config(logs, port, sockets)
        haproxy = Callgrind(["haproxy", "-f", str(config)], logs / "haproxy.log")
        try:
            wait_answering(port, haproxy.proc, "haproxy under callgrind", UNDER_VALGRIND)
            results["haproxy"] = measure(
                haproxy, port, SESSION, opts.requests, _keep(opts, "haproxy")
            )
        finally:
            haproxy.stop()
        argv = ["haproxy", "-f", str(config)]
        results["haproxy"] |= _prefixed(syscalls(argv, port, lambda _: SESSION, opts.requests))
        port = free_port()
        argv = [
            sys.executable, "-m", "gym_proxy", "asgi_counter:app", "--app-dir", str(HERE),
            "--workers", str(opts.workers), "--port", str(port), "--runtime-dir", runtime,
            "--log-level", "warning", "--secret", "bench",
        ]  # fmt: skip
        proxy = Callgrind(argv, logs / "gym-proxy.log")
        try:
            wait_answering(port, proxy.proc, "gym-proxy under callgrind", UNDER_VALGRIND)
            token = _token(port)
            results["gym-proxy"] = measure(
                proxy, port, token, opts.requests, _keep(opts, "gym-proxy")
            )
        finally:
            proxy.stop()
        # each run a new gym-proxy: a session of its own
        results["gym-proxy"] |= _prefixed(syscalls(argv, port, _token, opts.requests))
    finally:
        backends.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"instructions-{stamp}.json"
    options = {**vars(opts), "keep": None if opts.keep is None else str(opts.keep)}
    out.write_bytes(
        orjson.dumps({"options": options, "results": results}, option=orjson.OPT_INDENT_2)
    )
    print(f"raw results: {out.relative_to(HERE.parent)}; logs in {logs}\n", file=sys.stderr)
    print(table(results, opts))


def _keep(opts: argparse.Namespace, front: str) -> Path | None:
    return None if opts.keep is None else opts.keep / f"{front}-"


def _prefixed(calls: dict[str, float]) -> dict[str, float]:
    return {f"syscalls_{cell}": value for cell, value in calls.items()}


def _token(port: int) -> str:
    """A gym-proxy session: its token header, as a client sends it back."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"POST /seed_session HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 2\r\n\r\n{}"
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
    found = re.search(rb"(?i)x-nemo-gym-session-token:\s*(\S+)", data)
    if found is None:
        raise RuntimeError("gym-proxy gave no session token")
    return f"x-nemo-gym-session-token: {found.group(1).decode()}\r\n"


def table(results: dict[str, dict[str, float]], opts: argparse.Namespace) -> str:
    lines = [
        f"Per request ({opts.requests} a cell, one at a time, {opts.workers} worker(s); "
        "instructions with the front end's own idle rate taken off)",
        "",
        "| cell | HAProxy Ir | gym-proxy Ir | ratio | HAProxy syscalls | gym-proxy syscalls |",
        "|---|---|---|---|---|---|",
    ]
    hap, gp = results["haproxy"], results["gym-proxy"]
    for cell in CELLS:
        ratio = gp[cell] / hap[cell]
        calls = f"{hap['syscalls_' + cell]:.1f} | {gp['syscalls_' + cell]:.1f}"
        lines.append(f"| {cell} | {hap[cell]:,.0f} | {gp[cell]:,.0f} | {ratio:.2f}x | {calls} |")
    idle = f"{hap['idle_per_second']:,.0f} | {gp['idle_per_second']:,.0f}"
    lines.append(f"| idle, per second | {idle} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
