"""Move benchmark: the time to move every live session of one worker to another.

    python bench/moves.py [--sessions 1000 10000]

For each count: starts gym-proxy (counter app, 2 workers, control token), seeds that many
counter sessions, moves every session of worker 0 to worker 1 in one call, checks a
sample of the moved counters, and, as the baseline in the same run, times the other way
to take sessions off a worker today: a checkpoint of the whole server (prepare, commit,
resume; a restore onto fresh workers would come on top). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import CONTROL, TOKEN_HEADER, control, start, wait_up  # noqa: E402

MOVE = "/ng-control/v1/gym-proxy/sessions/move"


async def one_run(http: aiohttp.ClientSession, sessions: int) -> dict[str, float]:
    runtime = tempfile.mkdtemp(prefix="gpm-", dir="/tmp")
    proc, url = start(2, runtime)
    try:
        await wait_up(http, url)
        headers = {"Authorization": f"Bearer {CONTROL}"}
        async with http.get(f"{url}/ng-control/v1/checkpoint/status", headers=headers) as resp:
            owners = {w["owner"]: w["slot"] for w in (await resp.json())["workers"]}
        tokens: list[tuple[str, int]] = []

        async def seed(i: int) -> None:
            async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
                tokens.append((resp.headers[TOKEN_HEADER], i))

        await asyncio.gather(*(seed(i) for i in range(sessions)))
        # A token is v2.<instance tag>.<session>.<owner>.<mac>.
        on_zero = [t for t in tokens if owners[t[0].split(".")[3]] == 0]
        body = {
            "session_ids": [t.split(".")[2] for t, _ in on_zero],
            "to_slot": 1,
            "timeout_s": 600,
        }
        started = time.perf_counter()
        async with http.post(f"{url}{MOVE}", json=body, headers=headers) as resp:
            reply = await resp.json()
        moved_in = time.perf_counter() - started
        if resp.status != 200 or reply["failed"] or len(reply["moved"]) != len(on_zero):
            raise SystemExit(f"move failed: {resp.status} {str(reply)[:300]}")
        for token, count in random.Random(0).sample(on_zero, min(200, len(on_zero))):
            async with http.post(f"{url}/get_counter_value", headers={TOKEN_HEADER: token}) as r:
                assert (await r.json())["count"] == count
        checkpoint = await control(http, url, "prepare", checkpoint_id="m1")
        checkpoint += await control(
            http, url, "commit", checkpoint_id="m1", checkpoint_dir=f"{runtime}/checkpoint"
        )
        checkpoint += await control(http, url, "resume", checkpoint_id="m1")
        return {"moved": len(on_zero), "move": moved_in, "checkpoint": checkpoint}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1000, 10_000])
    opts = parser.parse_args()
    rows = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64), cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        for sessions in opts.sessions:
            rows.append((sessions, await one_run(http, sessions)))
    print("gym-proxy move bench: counter sessions on 2 workers, every session of worker 0")
    print("moved to worker 1 in one call; baseline: a checkpoint of the whole server")
    print("(prepare + commit + resume), same run; 200 moved counters checked")
    print()
    columns = ["sessions on the server", "moved", "move s", "us per moved session"]
    columns += ["checkpoint s", "move / checkpoint"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for sessions, r in rows:
        print(
            f"| {sessions:,} | {r['moved']:,} | {r['move']:.3f} | "
            f"{r['move'] * 1e6 / r['moved']:.1f} | {r['checkpoint']:.3f} | "
            f"{r['move'] / r['checkpoint']:.2f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
