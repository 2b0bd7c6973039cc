"""Local against placed workers: what the TCP hop and its link cost per request.

    .venv313/bin/python bench/placement.py [--seconds 5] [--workers 2] [--connections 1 16 64]
                                           [--rounds 2]

Ray must be installed (the NeMo Gym tier's venv has it). The same app (the ASGI counter,
`bench/asgi_counter.py`) and the same load (`bench/loadgen.py`: C keep-alive connections,
sessions drawn from one pool) against two servers on this host:

- **local**: gym-proxy with N workers on Unix sockets (the default placement);
- **placed**: gym-proxy `--worker-placement ray` with N workers on a one-node Ray cluster
  gym-proxy starts itself: the same workers, on TCP ports behind their gates, each pooled
  connection opened with the link's handshake (docs/ray.md).

The servers run one after the other, alternating for `--rounds` rounds (the machine is
shared: compare within a round). Per cell: req/s, p50/p99 latency, the proxy process's
CPU per request, and placed/local ratios. On one host the hop is loopback TCP instead of
a Unix socket; between machines add the network's round trip to each request.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
from routing import measure
from servers import FrontEnd, GymProxy, post

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PLACED = ("--worker-placement", "ray", "--worker-cpus", "0.1")


def front(proxy: GymProxy, sessions: int) -> FrontEnd:
    """gym-proxy's port, its sessions seeded; CPU charged to the proxy process."""
    seeded = []
    for _ in range(sessions):
        _, headers, _ = post(proxy.port, "/seed_session")
        seeded.append((0, f"x-nemo-gym-session-token: {headers['x-nemo-gym-session-token']}\r\n"))
    return FrontEnd("gym-proxy", [{"tcp": f"127.0.0.1:{proxy.port}"}], seeded, [proxy.proc.pid],
                    [proxy.proc.pid])  # fmt: skip


def run_server(kind: str, opts: argparse.Namespace, directory: str) -> dict[str, Any]:
    proxy = GymProxy(opts.workers, *(PLACED if kind == "placed" else ()), local=kind == "local")
    try:
        target = front(proxy, max(512, max(opts.connections)))
        plan = target.plan(directory)
        cells = {}
        for connections in opts.connections:
            cell = measure(target, plan, opts.seconds, connections)
            cells[str(connections)] = cell
            print(f"  {kind:<6} {connections:>4} conns {cell['rps']:>9,.0f} req/s "
                  f"p99 {cell['p99_ms']:.2f} ms", file=sys.stderr)  # fmt: skip
        return cells
    finally:
        proxy.stop()


def table(rounds: list[dict[str, dict[str, Any]]], connections: list[int]) -> str:
    lines = [
        "| round | conns | local req/s | placed req/s | ratio | local p99 ms | placed p99 ms | "
        "local proxy us/req | placed proxy us/req |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for number, cells in enumerate(rounds, 1):
        for c in map(str, connections):
            local, placed = cells["local"][c], cells["placed"][c]
            lines.append(
                f"| {number} | {c} | {local['rps']:,.0f} | {placed['rps']:,.0f} | "
                f"{placed['rps'] / local['rps']:.2f} | {local['p99_ms']:.2f} | "
                f"{placed['p99_ms']:.2f} | {local['front_cpu_us']:.1f} | "
                f"{placed['front_cpu_us']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    os.environ.pop("RAY_ADDRESS", None)  # a cluster of gym-proxy's own, on this host
    directory = tempfile.mkdtemp(prefix="gpp-", dir="/tmp")
    rounds = []
    for number in range(opts.rounds):
        print(f"round {number + 1}", file=sys.stderr)
        rounds.append({kind: run_server(kind, opts, directory) for kind in ("local", "placed")})
    print(table(rounds, opts.connections))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"placement-{stamp}.json"
    raw = {"options": vars(opts), "rounds": rounds}
    out.write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print(f"\nraw results: {out.relative_to(HERE.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
