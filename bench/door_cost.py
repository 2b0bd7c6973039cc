"""What a NeMo Gym server's process costs per call behind gym-proxy, beside the same server
run as NeMo Gym runs it.

    .venv313/bin/python bench/door_cost.py [--rollouts 300] [--concurrency 1 32]

NeMo Gym's `example_session_state_mgmt` counter, unmodified, two ways in one run: one
process as NeMo Gym starts it (`python app.py`: uvicorn on a TCP port) and gym-proxy with
one worker (the same class in the worker's NeMo Gym mode, uvicorn on the worker's Unix
socket, gym-proxy's door around the app). Each rollout makes the calls NeMo Gym's
simple_agent makes of it (seed, three increments, a read, verify: 6 calls, each with the
cookies of the last answer) and checks the count. The table gives the server process's
CPU per call (under gym-proxy: the worker's, then the proxy's own), for each
concurrency, and the worker's excess over the plain process: what the door, the Unix
socket and the worker's headers cost the app's process (issue 29.1's target for the door:
25 us a call). Needs the Python 3.13 virtualenv with NeMo Gym (tests/nemo_gym/install.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.servers import cpu_seconds  # noqa: E402
from tests.nemo_gym_stack import CounterClient, NemoStack  # noqa: E402

CALLS_PER_ROLLOUT = 6


def server_processes(stack: NemoStack) -> tuple[int, list[int]]:
    """The resources server's leader (the proxy, or the plain process) and the other
    processes of its group (the worker, and with --preload the zygote)."""
    leader = stack.procs["resources"].pid
    others = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != leader:
            try:
                if os.getpgid(int(entry.name)) == leader:
                    others.append(int(entry.name))
            except OSError:
                continue
    return leader, others


async def rollouts(url: str, count: int, concurrency: int) -> None:
    """`count` rollouts, `concurrency` at a time, each checking its own count."""
    queue = list(range(count))

    async def runner(http: aiohttp.ClientSession) -> None:
        while queue:
            task = queue.pop()
            client = CounterClient(http, url, task)
            await client.seed(task)
            for _ in range(3):
                await client.post("/increment_counter", {"count": 2})
            assert await client.count() == task + 6, "a call reached a worker without the session"
            assert await client.verify(task + 6) == 1.0

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        await asyncio.gather(*(runner(http) for _ in range(concurrency)))


async def measure(stack: NemoStack, count: int, concurrencies: list[int]) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession() as http:
        try:
            stack.start(roles=("resources",))
            await stack.wait_serving(http, within=180)
            url = stack.url("resources")
            await rollouts(url, 50, 8)  # warm: imports, pools, the collector's first passes
            for concurrency in concurrencies:
                leader, others = server_processes(stack)
                before = {pid: cpu_seconds(pid) for pid in [leader, *others]}
                await rollouts(url, count, concurrency)
                spent = {pid: cpu_seconds(pid) - cpu for pid, cpu in before.items()}
                calls = count * CALLS_PER_ROLLOUT
                rows.append(
                    {
                        "concurrency": concurrency,
                        "leader_us": 1e6 * spent[leader] / calls,
                        "others_us": 1e6 * sum(spent[p] for p in others) / calls,
                    }
                )
        finally:
            stack.stop()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-door-"))
    one = NemoStack(root / "one", workers=None)
    proxied = NemoStack(root / "proxy", workers={"resources": 1}, access_log=False)
    plain = await measure(one, opts.rollouts, opts.concurrency)
    print("  one process: done", file=sys.stderr)
    behind = await measure(proxied, opts.rollouts, opts.concurrency)
    print(
        f"\n{opts.rollouts} rollouts of {CALLS_PER_ROLLOUT} calls to NeMo Gym's counter at each "
        f"concurrency, {os.cpu_count()} cores\n"
    )
    print(
        "| concurrency | one process: CPU us/call | gym-proxy worker: CPU us/call "
        "| worker's excess | gym-proxy proxy: CPU us/call |"
    )
    print("|---|---|---|---|---|")
    for base, row in zip(plain, behind, strict=True):
        excess = row["others_us"] - base["leader_us"]
        print(
            f"| {row['concurrency']} | {base['leader_us']:.0f} | {row['others_us']:.0f} "
            f"| {excess:+.0f} | {row['leader_us']:.0f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
