"""NeMo Gym's own stack: rollouts per second, and how many are right, in one run.

    .venv313/bin/python bench/nemo_gym_stack.py [--rollouts 400] [--concurrency 32]
        [--workers 4,4,4,2]

The four released servers of the NeMo Gym tier (tests/nemo_gym_stack.py: legacy_agent,
simple_agent, the example_session_state_mgmt counter, openai_model on the scripted
policy), driven by NeMo Gym's rollout collection, three ways:

- one process per server, as NeMo Gym runs it (`python app.py`): the only correct way
  today, the baseline;
- each server behind its own gym-proxy with N workers (`--workers`, per server in the
  order environment, agent, resources, model);
- each server under `uvicorn --workers N` on one port (bench/nemo_gym_uvicorn.py): fast,
  and wrong, since a session's calls land on any process.

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
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.servers import cpu_seconds  # noqa: E402
from tests.nemo_gym_stack import SPECS, NemoStack, counter_rows  # noqa: E402


def group_cpu(stack: NemoStack) -> float:
    """CPU seconds of every live process of the stack's servers (their process groups)."""
    groups = {stack.procs[spec.role].pid for spec in SPECS if spec.role in stack.procs}
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) in groups:
                total += cpu_seconds(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return total


async def measure(
    name: str, stack: NemoStack, rollouts: int, concurrency: int
) -> dict[str, float | str]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        try:
            stack.start()
            await stack.wait_serving(http, within=180)
            stack.start_rollouts(counter_rows(concurrency, seed=1), concurrency).result()  # warm
            cpu = group_cpu(stack)
            started = time.monotonic()
            run = stack.start_rollouts(counter_rows(rollouts, seed=2), concurrency).result(900)
            elapsed = time.monotonic() - started
            cpu = group_cpu(stack) - cpu
        finally:
            stack.stop()
    return {
        "name": name,
        "finished": run.finished,
        "right": run.right / rollouts,
        "seconds": elapsed,
        "per_second": run.finished / elapsed,
        "cpu_ms": 1000 * cpu / max(1, run.finished),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", default="4,4,4,2", help="environment,agent,resources,model")
    opts = parser.parse_args()
    counts = [int(n) for n in opts.workers.split(",")]
    workers = dict(zip(("env", "agent", "resources", "model"), counts, strict=True))
    root = Path(tempfile.mkdtemp(prefix="bench-nemo-"))
    label = "/".join(str(n) for n in counts)
    runs = [
        ("one process per server", NemoStack(root / "one", workers=None)),
        (f"gym-proxy {label}", NemoStack(root / "proxy", workers=workers)),
        (
            f"uvicorn --workers {label}",
            NemoStack(root / "uvicorn", workers=workers, uvicorn_workers=True),
        ),
    ]
    results = []
    for name, stack in runs:
        results.append(await measure(name, stack, opts.rollouts, opts.concurrency))
        print(f"  {name}: done", file=sys.stderr)
    base = results[0]["per_second"]
    print(f"\n{opts.rollouts} rollouts at concurrency {opts.concurrency}, {os.cpu_count()} cores\n")
    print("| stack | rollouts/s | vs one process | reward 1.0 | finished | CPU ms/rollout |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['per_second']:.1f} | {r['per_second'] / base:.2f}x "
            f"| {100 * r['right']:.0f}% | {r['finished']} | {r['cpu_ms']:.0f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
