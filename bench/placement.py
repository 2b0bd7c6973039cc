"""Local against placed workers, on gym-proxy's node and on another: what the link costs.

    .venv313/bin/python bench/placement.py [--seconds 5] [--workers 2] [--connections 1 16 64]
                                           [--rounds 2]

Ray must be installed (the NeMo Gym tier's venv has it). The bench starts a two-node Ray
cluster on this host (`tests/ray_nodes.py`: the head, where gym-proxy's placement driver
joins, offers the custom resource `near`; the second node `far`), then serves the same
app (the ASGI counter, `bench/asgi_counter.py`) with the same load (`bench/loadgen.py`:
C keep-alive connections, sessions drawn from one pool) through three servers:

- **local**: gym-proxy with N workers on Unix sockets (the default placement);
- **near**: `--worker-placement ray` with each worker asking for `near`: placed on
  gym-proxy's own node, where its gate listens on a Unix socket in gym-proxy's runtime
  directory (docs/ray.md);
- **far**: the same asking for `far`: placed on the other node, its gate on a TCP port
  of that node. Both "nodes" share this host, so its hop is loopback TCP; between
  machines add the network's round trip to each request.

The servers run one after the other, alternating for `--rounds` rounds (the machine is
shared: compare within a round). Per cell: req/s, p99 latency, and the proxy process's
CPU per request, with near/local and far/local ratios.
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
from servers import REPO, FrontEnd, GymProxy, post

sys.path.insert(0, str(REPO))
from tests.ray_nodes import RayNodes  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
KINDS = ("local", "near", "far")
ROOM = 100.0  # of each custom resource: every worker of a run fits


def placed(resource: str) -> tuple[str, ...]:
    return ("--worker-placement", "ray", "--worker-cpus", "0.1",
            "--worker-resources", f'{{"{resource}": 1}}')  # fmt: skip


def front(proxy: GymProxy, sessions: int) -> FrontEnd:
    """gym-proxy's port, its sessions seeded; CPU charged to the proxy process."""
    seeded = []
    for _ in range(sessions):
        _, headers, _ = post(proxy.port, "/seed_session")
        seeded.append((0, f"x-nemo-gym-session-token: {headers['x-nemo-gym-session-token']}\r\n"))
    return FrontEnd("gym-proxy", [{"tcp": f"127.0.0.1:{proxy.port}"}], seeded, [proxy.proc.pid],
                    [proxy.proc.pid])  # fmt: skip


def run_server(
    kind: str, opts: argparse.Namespace, directory: str, ray_env: dict[str, str]
) -> dict[str, Any]:
    extra = () if kind == "local" else placed(kind)
    env = {} if kind == "local" else ray_env
    proxy = GymProxy(opts.workers, *extra, local=kind == "local", env=env)
    try:
        target = front(proxy, max(512, max(opts.connections)))
        plan = target.plan(directory)
        cells = {}
        for connections in opts.connections:
            cell = measure(target, plan, opts.seconds, connections)
            cells[str(connections)] = cell
            print(f"  {kind:<6} {connections:>4} conns {cell['rps']:>9,.0f} req/s "
                  f"p99 {cell['p99_ms']:.2f} ms {cell['front_cpu_us']:.1f} us/req",
                  file=sys.stderr)  # fmt: skip
        return cells
    finally:
        proxy.stop()


def table(rounds: list[dict[str, dict[str, Any]]], connections: list[int]) -> str:
    lines = [
        "| round | conns | req/s local / near / far | p99 ms local / near / far | "
        "proxy us/req local / near / far | near/local us | far/local us |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, cells in enumerate(rounds, 1):
        for c in map(str, connections):
            local, near, far = (cells[kind][c] for kind in KINDS)
            lines.append(
                f"| {number} | {c} | {local['rps']:,.0f} / {near['rps']:,.0f} / "
                f"{far['rps']:,.0f} | {local['p99_ms']:.2f} / {near['p99_ms']:.2f} / "
                f"{far['p99_ms']:.2f} | {local['front_cpu_us']:.1f} / "
                f"{near['front_cpu_us']:.1f} / {far['front_cpu_us']:.1f} | "
                f"{near['front_cpu_us'] / local['front_cpu_us']:.2f}x | "
                f"{far['front_cpu_us'] / local['front_cpu_us']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="gpp-", dir="/tmp")
    nodes = RayNodes(Path(tempfile.mkdtemp(prefix="gpr-", dir="/tmp")))
    rounds = []
    try:
        head = nodes.start_head({"near": ROOM})
        second = nodes.add_node({"far": ROOM})
        nodes.wait_started(head, 120)
        nodes.wait_started(second, 120)
        ray_env = {**nodes.environment, "RAY_ADDRESS": nodes.address}
        for number in range(opts.rounds):
            print(f"round {number + 1}", file=sys.stderr)
            rounds.append({kind: run_server(kind, opts, directory, ray_env) for kind in KINDS})
    finally:
        nodes.stop()
    print(table(rounds, opts.connections))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"placement-{stamp}.json"
    raw = {"options": vars(opts), "kinds": KINDS, "rounds": rounds}
    out.write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print(f"\nraw results: {out.relative_to(HERE.parent)}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)  # the bench's own cluster, named per server
    main()
