"""What a new connection costs the event loop alone, in instructions (issue 40).

    .venv/bin/python bench/accept_floor.py [--connections 300]

bench/instructions.py's `connect` cell (a new connection for each GET) is where
gym-proxy is furthest from HAProxy. This bench asks how much of that is the event loop
gym-proxy is built on, before any of gym-proxy's code: three servers that answer every
request with the same fixed response and no backend, each under callgrind, counted the
same way (Callgrind from instructions.py) over `--connections` connections of one GET
each (connect, send, read the answer, close):

- `uvloop`: a `loop.create_server` of the smallest BufferedProtocol (one shared buffer;
  the transport, its callbacks and its close are uvloop's), as the proxy's front door;
- `readers`: uvloop's `add_reader` on each accepted descriptor, reads and writes on the
  descriptor itself (`os.read`/`os.write`): an accept path of one's own on the same loop,
  interpreted (compiled, its own code would cost less; the loop's part would not);
- `haproxy`: HAProxy answering by itself (`http-request return`), one thread.

Prints instructions per connection and writes bench/results/accept-floor-<stamp>.json.
Needs valgrind and haproxy.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import orjson
from instructions import UNDER_VALGRIND, Callgrind
from servers import free_port, wait_answering

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
REQUEST = b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n"
SERVERS = ("uvloop", "readers", "haproxy")


# ---- the servers (run as `accept_floor.py --serve <kind> <port>`) -----------------------
class _Answer(asyncio.BufferedProtocol):
    buffer = bytearray(65536)  # shared: a fresh one per connection would be measured

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.transport.write(ANSWER)


async def _serve_uvloop(port: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(_Answer, "127.0.0.1", port, backlog=128)
    await asyncio.Event().wait()


async def _serve_readers(port: int) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    listener.setblocking(False)

    def readable(fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            os.write(fd, ANSWER)
        else:
            loop.remove_reader(fd)
            os.close(fd)

    def accept() -> None:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # the descriptor, no socket object
        except BlockingIOError:
            return
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable, fd)

    loop.add_reader(listener.fileno(), accept)
    await asyncio.Event().wait()


def serve(kind: str, port: int) -> None:
    import uvloop

    uvloop.run(_serve_uvloop(port) if kind == "uvloop" else _serve_readers(port))


# ---- the measure ------------------------------------------------------------------------
def connections(port: int, count: int) -> float:
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(REQUEST)
            got = b""
            while not got.endswith(b"ok"):
                piece = sock.recv(4096)
                if not piece:
                    raise SystemExit(f"the server on {port} closed before answering")
                got += piece
    return 1.0


def argv_of(kind: str, port: int, directory: Path) -> list[str]:
    if kind != "haproxy":
        return [sys.executable, __file__, "--serve", kind, str(port)]
    config = directory / "haproxy.cfg"
    config.write_text(
        "global\n  maxconn 1000\n  nbthread 1\n"
        "defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n"
        "  timeout server 60s\n"
        f"frontend fe\n  bind 127.0.0.1:{port}\n"
        "  http-request return status 200 content-type text/plain string ok\n"
    )
    return ["haproxy", "-f", str(config)]


def measure(kind: str, count: int, logs: Path) -> float:
    port = free_port()
    server = Callgrind(argv_of(kind, port, logs), logs / f"{kind}.log")
    try:
        wait_answering(port, server.proc, f"{kind} under callgrind", UNDER_VALGRIND)
        connections(port, 20)  # warm
        total, _ = server.counted(lambda: connections(port, count))
    finally:
        server.stop()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.serve:
        serve(opts.serve[0], int(opts.serve[1]))
        return
    for tool in ("valgrind", "callgrind_control", "haproxy"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench/accept_floor.py needs {tool} (apt-get install {tool})")
    logs = Path(tempfile.mkdtemp(prefix="gpa-", dir="/tmp"))
    results = {kind: measure(kind, opts.connections, logs) for kind in SERVERS}
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"accept-floor-{stamp}.json"
    out.write_bytes(orjson.dumps({"options": vars(opts), "results": results}))
    print(f"raw results: {out.relative_to(HERE.parent)}; logs in {logs}\n", file=sys.stderr)
    print(f"Instructions per connection (one GET each, {opts.connections} connections)\n")
    print("| server | Ir per connection | against HAProxy |\n|---|---|---|")
    for kind in SERVERS:
        print(f"| {kind} | {results[kind]:,.0f} | {results[kind] / results['haproxy']:.2f}x |")


if __name__ == "__main__":
    main()
