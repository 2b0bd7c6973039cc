"""From every worker busy to a new worker serving: a local worker against a placed one
whose node Ray's autoscaler adds for it.

    .venv313/bin/python bench/cluster_autoscale.py [--rounds 3]

Ray must be installed (the NeMo Gym tier's venv has it). The bench starts Ray's own
autoscaling test cluster on this host (`tests/ray_nodes.py`: the head, one CPU, with
Ray's autoscaler on its fake multi-node provider, which adds nodes of one CPU for
pending actors and removes them after 6 s idle). Each round runs the same command twice,
one after the other: gym-proxy with the tests' app (`tests/apps.py`, whose `/slow`
holds a request), `--min-workers 1 --max-workers 2 --scale-up-busy 2 --scale-up-after
1`, its one worker

- **local**: a process of this machine;
- **placed**: `--worker-placement ray --worker-cpus 1`, on the head; the second worker
  does not fit, so its actor waits for the node Ray's autoscaler adds.

Eight clients then call `/slow?seconds=0.3` on four sessions back to back. Per server:
the seconds from the load's start to gym-proxy's grow (its `--scale-up-after`, the
same for both), and from the grow to the second worker serving (`status` lists it):
for the placed one that includes Ray adding the node. Between rounds the bench waits
until the autoscaler has removed the added node again.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from servers import HERE, REPO, free_port, terminate, wait_answering

sys.path.insert(0, str(REPO))
from tests.ray_nodes import RayNodes, RayState  # noqa: E402

RESULTS = HERE / "results"
CONTROL = "bench-control"
AUTH = {"Authorization": f"Bearer {CONTROL}"}
TOKEN = "x-nemo-gym-session-token"
NODE = {"resources": {"CPU": 1, "object_store_memory": 100 * 2**20}, "max_workers": 1}
PLACED = ("--worker-placement", "ray", "--worker-cpus", "1")


class Proxy:
    def __init__(self, extra: tuple[str, ...], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runtime = tempfile.mkdtemp(prefix="gca-", dir="/tmp")
        self.log = Path(self.runtime) / "proxy.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gym_proxy", "tests.apps:create_app", "--workers", "1",
                 "--min-workers", "1", "--max-workers", "2", "--scale-up-busy", "2",
                 "--scale-up-after", "1", "--port", str(self.port), "--runtime-dir",
                 self.runtime, "--secret", "bench", "--control-token", CONTROL,
                 "--boot-timeout", "180", *extra],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
            )  # fmt: skip
        wait_answering(self.port, self.proc, f"gym-proxy (see {self.log})")


async def status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/ng-control/v1/checkpoint/status", headers=AUTH) as reply:
        return dict(await reply.json())


async def grow(proxy: Proxy) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        tokens = []
        for _ in range(4):
            async with http.post(f"{proxy.url}/seed_session", json={}) as reply:
                tokens.append(reply.headers[TOKEN])
        stop = asyncio.Event()
        failed = 0

        async def client(token: str) -> None:
            nonlocal failed
            while not stop.is_set():
                url = f"{proxy.url}/slow?seconds=0.3"
                async with http.get(url, headers={TOKEN: token}) as reply:
                    failed += reply.status != 200

        began = time.monotonic()
        load = [asyncio.ensure_future(client(tokens[i % 4])) for i in range(8)]
        decided = serving = 0.0
        try:
            while time.monotonic() - began < 300:
                now = await status(http, proxy.url)
                running = now["operations"]["running"]
                if not decided and running is not None and running["reason"] == "autoscale":
                    decided = time.monotonic()
                if len(now["workers"]) == 2:
                    serving = time.monotonic()
                    break
                await asyncio.sleep(0.05)  # the poll's pace: a measurement, not a wait
        finally:
            stop.set()
            await asyncio.gather(*load)
        if not serving:
            raise SystemExit(f"no second worker in 300 s (see {proxy.log})")
        return {"to_grow_s": (decided or serving) - began, "grow_to_serving_s": serving
                - (decided or serving), "failed": failed}  # fmt: skip


def run(kind: str, env: dict[str, str], state: RayState) -> dict[str, float]:
    proxy = Proxy(PLACED if kind == "placed" else (), env)
    try:
        result = asyncio.run(grow(proxy))
    finally:
        terminate(proxy.proc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the added node removed: the next round adds it
        if sum(n["state"] == "ALIVE" for n in state.ask("nodes")) == 1:
            break
        time.sleep(0.5)
    print(f"  {kind:<6} {result}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    nodes = RayNodes(Path(tempfile.mkdtemp(prefix="gcr-", dir="/tmp")))
    rounds = []
    try:
        head = nodes.start_autoscaling_head(1, {"node": NODE})
        nodes.wait_started(head, 120)
        state = RayState(nodes)
        env = {**nodes.environment, "RAY_ADDRESS": nodes.address}
        for number in range(opts.rounds):
            print(f"round {number + 1}", file=sys.stderr)
            rounds.append({kind: run(kind, env, state) for kind in ("local", "placed")})
        state.close()
    finally:
        nodes.stop()
    print("| round | load to grow s local / placed | grow to serving s local / placed "
          "| placed / local | failed calls |")  # fmt: skip
    print("|---|---|---|---|---|")
    for number, r in enumerate(rounds, 1):
        local, placed = r["local"], r["placed"]
        print(
            f"| {number} | {local['to_grow_s']:.2f} / {placed['to_grow_s']:.2f} "
            f"| {local['grow_to_serving_s']:.2f} / {placed['grow_to_serving_s']:.2f} "
            f"| {placed['grow_to_serving_s'] / local['grow_to_serving_s']:.2f}x "
            f"| {int(local['failed'] + placed['failed'])} |"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"cluster_autoscale-{stamp}.json"
    out.write_bytes(
        orjson.dumps({"options": vars(opts), "rounds": rounds}, option=orjson.OPT_INDENT_2)
    )


if __name__ == "__main__":
    main()
