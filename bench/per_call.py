"""What one proxied call costs the front end when the app takes time to answer.

    python bench/per_call.py [--calls 1500] [--app-ms 0 1 5]

NeMo Gym's servers answer in 0.5-5 ms (pydantic, FastAPI), and each rollout's client
makes one call at a time: between a call's request and its answer the front end has
nothing to do, and sleeps. This bench puts the routing bench's app (`asgi_counter.py`,
its `/wait?ms=N` path) behind gym-proxy with one worker and behind HAProxy (one thread,
to the same worker's socket), and makes `--calls` calls one at a time over one
keep-alive connection (an aiohttp client, as NeMo Gym's), for each app time. Per cell:
calls per second and the front end's CPU per call (its own process), gym-proxy then
HAProxy at each app time, and their ratio. Raw results go to bench/results/per-call-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import time
from pathlib import Path

import aiohttp
import orjson
from servers import GymProxy, HAProxy, cpu_seconds, post

RESULTS = Path(__file__).resolve().parent / "results"


async def one_at_a_time(url: str, pid: int, app_ms: int, calls: int, headers: dict) -> dict:
    """`calls` calls in a row on one connection; the front end's CPU per call."""
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:

        async def call() -> None:
            async with http.post(f"{url}/wait?ms={app_ms}", data=b'{"count": 1}') as resp:
                assert resp.status == 200, resp.status
                await resp.read()

        for _ in range(20):  # warm: the connection, the pools
            await call()
        cpu, started = cpu_seconds(pid), time.monotonic()
        for _ in range(calls):
            await call()
        seconds = time.monotonic() - started
        return {"per_second": calls / seconds, "cpu_us": 1e6 * (cpu_seconds(pid) - cpu) / calls}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--app-ms", type=int, nargs="+", default=[0, 1, 5])
    opts = parser.parse_args()
    if not HAProxy.installed():
        raise SystemExit("HAProxy is the baseline: apt-get install haproxy")
    proxy = GymProxy(1)
    haproxy = HAProxy(proxy.sockets(), proxy.workers(), 8)
    rows = []
    try:
        _, seeded, _ = post(proxy.port, "/seed_session")
        token = seeded["x-nemo-gym-session-token"]
        ends = {
            "gym-proxy": (f"http://127.0.0.1:{proxy.port}", proxy.proc.pid,
                          {"x-nemo-gym-session-token": token}),
            "haproxy": (f"http://127.0.0.1:{haproxy.port}", haproxy.proc.pid,
                        {"cookie": "GPW=w0", "x-ng-session-id": "hap-0"}),
        }  # fmt: skip
        for app_ms in opts.app_ms:
            cells = {}
            for name, (url, pid, headers) in ends.items():
                cells[name] = await one_at_a_time(url, pid, app_ms, opts.calls, headers)
            rows.append({"app_ms": app_ms, **cells})
    finally:
        haproxy.stop()
        proxy.stop()
    cores, gaps = os.cpu_count(), " ".join(map(str, opts.app_ms))
    print(f"\nper-call front-end CPU, one call at a time, {opts.calls} calls, {cores} cores")
    print(f"`python bench/per_call.py --calls {opts.calls} --app-ms {gaps}`\n")
    print(
        "| app time | gym-proxy calls/s | gym-proxy CPU us/call | HAProxy calls/s "
        "| HAProxy CPU us/call | gym-proxy / HAProxy CPU |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        g, h = row["gym-proxy"], row["haproxy"]
        print(
            f"| {row['app_ms']} ms | {g['per_second']:,.0f} | {g['cpu_us']:.0f} "
            f"| {h['per_second']:,.0f} | {h['cpu_us']:.0f} | {g['cpu_us'] / h['cpu_us']:.2f}x |"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    out = RESULTS / f"per-call-{stamp}.json"
    out.write_bytes(orjson.dumps({"calls": opts.calls, "rows": rows}, option=orjson.OPT_INDENT_2))
    print(f"\nraw: {out}")


if __name__ == "__main__":
    asyncio.run(main())
