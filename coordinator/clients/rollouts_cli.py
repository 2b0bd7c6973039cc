"""`gym-proxy-rollouts`: run R weather rollouts against an environment server.

    gym-proxy-rollouts --env http://127.0.0.1:8101 --rollouts 1000 --concurrency 64

Each rollout asks for one city's weather (`{"city": ...}`, cities cycling through a
fixed list, with `--prompt-bytes` of system prompt in `instructions`); a progress bar
shows on a terminal. Prints one JSON line: rollouts, finished, failed, reward_one
(replies with reward 1.0), seconds. Checkpoints of a running collection are driven with
`gym-proxy-ctl` (or `gym_proxy.coordinator.clients.controller` and
`gym_proxy.coordinator.clients.rollouts` as a library, as `bench/checkpoint_scale.py` does).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

import aiohttp
import orjson

from gym_proxy.coordinator.clients.rollouts import Rollout, RolloutDriver

__all__ = ["CITIES", "main", "weather_rollouts"]

CITIES = ("Oslo", "Lima", "Cairo", "Perth", "Quito", "Hanoi", "Dakar", "Riga")
SYSTEM_PROMPT = (
    "You are a careful weather assistant. Use the get_weather tool for every city the user "
    "names, then answer with the temperature in degrees Celsius, in one sentence. "
)


def weather_rollouts(count: int, prefix: str = "r", prompt_bytes: int = 0) -> list[Rollout]:
    """`count` weather tasks; with `prompt_bytes`, each carries a system prompt that long
    (agents keep it in the conversation they checkpoint, as real ones do)."""
    tasks = [{"city": CITIES[i % len(CITIES)]} for i in range(count)]
    if prompt_bytes > 0:
        prompt = (SYSTEM_PROMPT * (prompt_bytes // len(SYSTEM_PROMPT) + 1))[:prompt_bytes]
        for task in tasks:
            task["instructions"] = prompt
    return [Rollout(f"{prefix}{i}", task) for i, task in enumerate(tasks)]


async def _run(opts: argparse.Namespace) -> dict[str, object]:
    rollouts = weather_rollouts(opts.rollouts, opts.prefix, opts.prompt_bytes)
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        driver = RolloutDriver(opts.env, http, opts.concurrency, progress=not opts.quiet)
        await driver.run(rollouts)
    finished = [r for r in rollouts if r.finished]
    return {
        "rollouts": len(rollouts),
        "finished": len(finished),
        "failed": len(rollouts) - len(finished),
        "reward_one": sum(1 for r in finished if r.reply.get("reward") == 1.0),
        "seconds": round(time.monotonic() - started, 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gym-proxy-rollouts", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="the environment server's URL")
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prefix", default="r", help="rollout IDs are PREFIX0, PREFIX1, ...")
    parser.add_argument(
        "--prompt-bytes", type=int, default=0, help="a system prompt this long in every task"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    opts = parser.parse_args(argv)
    print(orjson.dumps(asyncio.run(_run(opts))).decode())


if __name__ == "__main__":
    main()
