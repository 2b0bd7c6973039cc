"""NeMo Gym's own stack: rollouts per second, and how many are right, in one run.

    .venv313/bin/python bench/nemo_gym_stack.py [--rollouts 400] [--concurrency 32]
        [--workers 4,4,4,2] [--server counter|structeval [--items 400]]

The four released servers of the NeMo Gym tier (tests/nemo_gym_stack.py: legacy_agent,
simple_agent, the example_session_state_mgmt counter, openai_model on the scripted
policy), driven by NeMo Gym's rollout collection, three ways:

- one process per server, as NeMo Gym runs it (`python app.py`): the only correct way
  today, the baseline;
- each server behind its own gym-proxy with N workers (`--workers`, per server in the
  order environment, agent, resources, model);
- each server under `uvicorn --workers N` on one port (bench/nemo_gym_uvicorn.py): fast,
  and wrong, since a session's calls land on any process.

`--server structeval` puts NeMo Gym's released structeval server in the counter's place
(its YAML answers of `--items` items, tests/nemo_gym/structured.py): a verifier that
spends its CPU in its own event loop, so that one process of it is the stack's
bottleneck, the case workers are for (`--workers 1,1,2,1`). It needs structeval's own
requirements in the virtualenv (tests/nemo_gym/install.sh installs them).

Each runs a warm-up, then `--rollouts` rollouts; the table gives rollouts per second, the
fraction whose reward is 1.0, and the CPU seconds per rollout of every server process
(proxies, workers, uvicorn processes; the backend and the driver not counted).
Needs the Python 3.13 virtualenv with NeMo Gym (tests/nemo_gym/install.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.servers import cpu_seconds  # noqa: E402
from tests.nemo_gym import structured  # noqa: E402
from tests.nemo_gym_stack import STRUCTEVAL, NemoStack, counter_rows  # noqa: E402

Rows = Callable[[int, int], list[dict[str, Any]]]  # (count, seed) -> the collection's rows


def group_cpu(stack: NemoStack) -> tuple[dict[str, float], float]:
    """CPU seconds of every live process of each server (its process group), and of the
    group leaders alone (under gym-proxy: the proxies)."""
    groups = {
        stack.procs[spec.role].pid: spec.role for spec in stack.specs if spec.role in stack.procs
    }
    by_role = dict.fromkeys(groups.values(), 0.0)
    leaders = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid = int(entry.name)
            role = groups.get(os.getpgid(pid))
            if role is not None:
                seconds = cpu_seconds(pid)
                by_role[role] += seconds
                leaders += seconds if pid in groups else 0.0
        except (OSError, ValueError, IndexError):
            continue
    return by_role, leaders


async def measure(
    name: str, stack: NemoStack, rollouts: int, concurrency: int, rows: Rows
) -> dict[str, float | str]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        try:
            stack.start()
            await stack.wait_serving(http, within=180)
            stack.start_rollouts(rows(concurrency, 1), concurrency).result()
            cpu, front = group_cpu(stack)
            backend = cpu_seconds(stack.procs["backend"].pid)
            rollouts_run = stack.start_rollouts(rows(rollouts, 2), concurrency)
            run = await asyncio.to_thread(rollouts_run.result, 900)
            driver = run.cpu
            elapsed = run.seconds  # inside the driver: its own start-up is not counted
            cpu_after, front_after = group_cpu(stack)
            roles = {role: cpu_after[role] - cpu.get(role, 0.0) for role in cpu_after}
            front = front_after - front
            backend = cpu_seconds(stack.procs["backend"].pid) - backend
        finally:
            stack.stop()
    return {
        "name": name,
        "finished": run.finished,
        "right": run.right / rollouts,
        "seconds": elapsed,
        "per_second": run.finished / elapsed,
        "cpu_ms": 1000 * sum(roles.values()) / max(1, run.finished),
        "roles": " / ".join(f"{1000 * roles[r] / max(1, run.finished):.1f}" for r in sorted(roles)),
        "front_ms": 1000 * front / max(1, run.finished),
        "driver_ms": 1000 * driver / max(1, run.finished),
        "backend_ms": 1000 * backend / max(1, run.finished),
    }


def task_rows(opts: argparse.Namespace) -> tuple[Any, Rows, str]:
    """The chosen resources server's stack (None: the counter's), rows and description."""
    if opts.server == "counter":

        def counter(count: int, seed: int) -> list[dict[str, Any]]:
            return counter_rows(count, opts.increments, seed)

        return None, counter, f"{opts.increments} increments each"

    def structeval(count: int, seed: int) -> list[dict[str, Any]]:
        return structured.rows(count, opts.items, seed * 100_000)

    size = len(structured.catalog(opts.items, 0)) / 1000
    return STRUCTEVAL, structeval, f"structeval, answers of {size:.0f} KB of YAML"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", default="4,4,4,2", help="environment,agent,resources,model")
    parser.add_argument(
        "--stacks",
        default="one,gym-proxy,uvicorn",
        help="which, of one,gym-proxy,gym-proxy-1,uvicorn",
    )
    parser.add_argument("--access-log", action="store_true", help="gym-proxy's access logs on")
    parser.add_argument("--increments", type=int, default=3, help="counter: tool calls each")
    parser.add_argument(
        "--server",
        choices=("counter", "structeval"),
        default="counter",
        help="the resources server: the stateful counter, or structeval (a CPU-bound verifier)",
    )
    parser.add_argument("--items", type=int, default=400, help="structeval: items per answer")
    opts = parser.parse_args()
    specs, rows, what = task_rows(opts)
    counts = [int(n) for n in opts.workers.split(",")]
    workers = dict(zip(("env", "agent", "resources", "model"), counts, strict=True))
    root = Path(tempfile.mkdtemp(prefix="bench-nemo-"))
    label = "/".join(str(n) for n in counts)
    ones = dict.fromkeys(workers, 1)
    log = opts.access_log
    chosen: dict[str, Any] = {} if specs is None else {"specs": specs}
    choices = {
        "one": ("one process per server", NemoStack(root / "one", workers=None, **chosen)),
        "gym-proxy": (
            f"gym-proxy {label}",
            NemoStack(root / "proxy", workers=workers, access_log=log, **chosen),
        ),
        "gym-proxy-1": (
            "gym-proxy 1/1/1/1",
            NemoStack(root / "proxy1", workers=ones, access_log=log, **chosen),
        ),
        "uvicorn": (
            f"uvicorn --workers {label}",
            NemoStack(root / "uvicorn", workers=workers, uvicorn_workers=True, **chosen),
        ),
    }
    runs = [choices[name] for name in opts.stacks.split(",")]
    results = []
    for name, stack in runs:
        results.append(await measure(name, stack, opts.rollouts, opts.concurrency, rows))
        print(f"  {name}: done", file=sys.stderr)
    base = results[0]["per_second"]
    print(
        f"\n{opts.rollouts} rollouts at concurrency {opts.concurrency}, "
        f"{what}, {os.cpu_count()} cores\n"
    )
    print(
        "| stack | rollouts/s | vs first | reward 1.0 | finished | server CPU ms/rollout "
        "| of it, gym-proxy processes | agent / env / model / resources | driver | backend |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        front = f"{r['front_ms']:.1f}" if r["name"].startswith("gym-proxy") else "-"
        print(
            f"| {r['name']} | {r['per_second']:.1f} | {r['per_second'] / base:.2f}x "
            f"| {100 * r['right']:.0f}% | {r['finished']} | {r['cpu_ms']:.1f} | {front} "
            f"| {r['roles']} | {r['driver_ms']:.1f} | {r['backend_ms']:.1f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
