"""The scale run: native single_turn weather rollouts across a crash.

    python bench/checkpoint_scale.py                    # 16,000 rollouts
    python bench/checkpoint_scale.py --rollouts 1000    # quick
    python bench/checkpoint_scale.py --rollouts 100000  # long
    python bench/checkpoint_scale.py --json             # + one JSON object on the last line

Every server of the reference stack (`gym_proxy.worker.apps.stack`) runs with 2 workers behind its
own gym-proxy. The fake model holds the second call of every rollout asking about half
of the cities; half the rollouts ask about those (`--in-flight`, capped by the
descriptor limit), so they are in flight (parked mid-turn) while the others finish.
Then: checkpoint (prepare in NeMo Gym's stage order, commit), kill every
process group, start again, restore, resume, and run every replacement (attempt N+1)
to the end. Prints rollouts, in flight at the checkpoint, exported, each phase's time
per server (the slowest is the phase's time), records MB per server, replacement
failures and rewards that are not 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gym_proxy.coordinator.clients.controller import Controller, Participant  # noqa: E402
from gym_proxy.coordinator.clients.rollouts import Rollout, RolloutDriver, exported_rollouts  # noqa: E402
from gym_proxy.coordinator.clients.rollouts_cli import CITIES, weather_rollouts  # noqa: E402
from gym_proxy.coordinator.contract.answers import RestoreAnswer
from gym_proxy.coordinator.contract.episodes import EpisodeId  # noqa: E402
from gym_proxy.worker.apps.stack import Stack  # noqa: E402

HELD_CITIES = CITIES[::2]
FREE_CITIES = CITIES[1::2]
# Each rollout in flight holds a client and a worker connection at every proxy it passes;
# a proxy keeps this many descriptors for its pools, channels and files.
FD_MARGIN = 3000


def in_flight_cap(concurrency: int) -> int:
    """Rollouts that can be in flight at once within this process's descriptor limit
    (every proxy and worker inherits it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, (hard - FD_MARGIN) // 2 - concurrency) // 1000 * 1000


def scale_rollouts(count: int, in_flight: int, prompt_bytes: int) -> list[Rollout]:
    """`count` rollouts, the first `in_flight` asking about a city the model holds."""
    rollouts = weather_rollouts(count, prompt_bytes=prompt_bytes)
    for i, rollout in enumerate(rollouts):
        cities = HELD_CITIES if i < in_flight else FREE_CITIES
        rollout.task["city"] = cities[i % len(cities)]
    return rollouts


async def _held(http: aiohttp.ClientSession, stack: Stack, controller: Controller) -> int:
    model = stack.urls["model"]
    status = next(p for p in controller.participants if p.url == model)
    total = 0
    for worker in (await status.status()).workers:
        async with http.get(f"{model}/held", headers={"x-ng-session-owner": worker.owner}) as r:
            total += (await r.json())["held"]
    return total


def _records_mb(directory: Path) -> dict[str, float]:
    """Records file size per server (`gym/<kind>/<name>/records-*.jsonl`)."""
    sizes: dict[str, float] = {}
    for path in directory.glob("gym/*/*/records-*.jsonl"):
        sizes[path.parent.name] = sizes.get(path.parent.name, 0.0) + path.stat().st_size / 1e6
    return sizes


def _failure_kinds(rollouts: list[Any]) -> dict[str, int]:
    """How the failed dispatches ended: `<status> <error code>` or the client error."""
    kinds: dict[str, int] = {}
    for rollout in rollouts:
        if rollout.history and not rollout.finished:
            reply = rollout.reply if isinstance(rollout.reply, dict) else {}
            code = (reply.get("error") or {}).get("code") if reply else None
            detail = str((reply.get("error") or {}).get("detail", reply))[:120] if reply else ""
            kind = rollout.error or f"{rollout.status} {code}: {detail}"
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _by_server(stack: Stack, timings: dict[str, float]) -> dict[str, float]:
    names = {url: name for name, url in stack.urls.items()}
    return {names[url]: round(seconds, 3) for url, seconds in timings.items()}


async def _restore_one_at_a_time(
    stack: Stack, controller: Controller, checkpoint_dir: str, episodes: list[EpisodeId]
) -> dict[str, float]:
    """Each server's restore with the machine to itself (`--restore-alone`): the
    controller's restore runs them at once, and on 2 cores four servers share them."""
    names = {url: name for name, url in stack.urls.items()}
    alone: dict[str, float] = {}
    body = {"checkpoint_id": "scale", "checkpoint_dir": checkpoint_dir}
    ids = [e.as_json() for e in episodes]
    for participant in controller.participants:
        started = time.perf_counter()
        await participant.call("restore", RestoreAnswer, time.time() + 600, episode_ids=ids, **body)
        alone[names[participant.url]] = round(time.perf_counter() - started, 3)
    return alone


async def cycle(opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    hold = work / "hold"
    hold.write_text("hold")
    env = {
        "GYM_FAKE_MODEL_HOLD_FILE": str(hold),
        "GYM_FAKE_MODEL_HOLD_CALLS": "2",
        "GYM_FAKE_MODEL_HOLD_CITIES": ",".join(HELD_CITIES),
    }
    stack = Stack(opts.workers, str(work / "stack"), env=env).start()
    held = opts.in_flight
    rollouts = scale_rollouts(opts.rollouts, held, opts.prompt_bytes)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        participants = [Participant(url, stack.control_token, http) for url in stack.urls.values()]
        controller = Controller(participants, timeout=600)
        await controller.learn_kinds()
        driver = RolloutDriver(stack.urls["env"], http, concurrency=held + opts.concurrency)
        started = time.monotonic()
        running = asyncio.ensure_future(driver.run(rollouts))
        while True:  # until the free half is done and the held half waits at the model
            await asyncio.sleep(0.5)
            # Finished first: a rollout may end between the two counts, never un-end.
            finished = sum(1 for r in rollouts if r.finished)
            done = sum(1 for r in rollouts if r.history)
            waiting = await _held(http, stack, controller)
            line = f"{finished} finished, {done - finished} failed, {waiting} held at the model"
            if sys.stderr.isatty():
                print(f"\r  running: {line} ", end="", file=sys.stderr, flush=True)
            if done + waiting >= len(rollouts):  # every rollout ended or held
                break
            if running.done():
                raise SystemExit(f"the rollouts ended early: {running.exception()}")
        print(f"\r  first run: {line}", file=sys.stderr)
        first_run = time.monotonic() - started
        first_failures = _failure_kinds(rollouts)
        if first_failures:
            print(f"  first run failures: {first_failures}", file=sys.stderr)
        ck = work / "ck"
        prepared = await controller.prepare("scale")
        if not prepared.prepared:
            raise SystemExit(f"prepare not ready: {prepared.blockers()}")
        replies = await controller.commit("scale", str(ck))
        exported = exported_rollouts(replies)
        prepare_s = _by_server(stack, controller.timings["prepare"])
        commit_s = _by_server(stack, controller.timings["commit"])
        stack.kill()
        await asyncio.wait_for(running, 120)
        hold.unlink()
        stack.start()
        await controller.learn_kinds()
        episodes = sorted(exported.values(), key=lambda e: e.key)
        if opts.restore_alone:
            restore_s = await _restore_one_at_a_time(stack, controller, str(ck), episodes)
        else:
            await controller.restore("scale", str(ck), episodes)
            restore_s = _by_server(stack, controller.timings["restore"])
        await controller.resume("scale")
        RolloutDriver.continue_after_restore(rollouts, set(exported))
        started = time.monotonic()
        await driver.run(rollouts)
        second_run = time.monotonic() - started
    stack.stop()
    failures = [r for r in rollouts if not r.finished]
    return {
        "rollouts": len(rollouts),
        "in_flight": held,
        "exported": len(exported),
        "prepare_s": max(prepare_s.values()),
        "commit_s": max(commit_s.values()),
        "restore_s": max(restore_s.values()),
        "prepare_by_server_s": prepare_s,
        "commit_by_server_s": commit_s,
        "restore_by_server_s": restore_s,
        "records_mb": {k: round(v, 2) for k, v in _records_mb(ck).items()},
        "replacement_failures": len(failures),
        "rewards_not_one": sum(1 for r in rollouts if r.finished and r.reply.get("reward") != 1.0),
        "replacement_failure_kinds": _failure_kinds(rollouts),
        "first_run_failures": first_failures,
        "first_run_s": round(first_run, 1),
        "replacements_s": round(second_run, 1),
        "workers": opts.workers,
        "prompt_bytes": opts.prompt_bytes,
        "restore_alone": opts.restore_alone,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16000)
    parser.add_argument("--workers", type=int, default=2, help="workers per server")
    parser.add_argument(
        "--concurrency", type=int, default=256, help="rollouts running besides the held ones"
    )
    parser.add_argument(
        "--prompt-bytes",
        type=int,
        default=1400,
        help="system prompt per task, kept in the agent's conversation (NeMo Gym's scale "
        "run wrote about 2 KB of agent record per rollout)",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        help="rollouts held at the model at the checkpoint (default: half, within what the "
        "descriptor limit allows)",
    )
    parser.add_argument(
        "--restore-alone",
        action="store_true",
        help="restore the servers one after another, not at once: each one's restore with "
        "the machine to itself",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per held rollout
    cap = in_flight_cap(opts.concurrency)
    if opts.in_flight is None:
        opts.in_flight = min(opts.rollouts // 2, cap)
        if opts.in_flight < opts.rollouts // 2:
            note = f"{hard:,} descriptors per process; each in flight holds 2 at every proxy"
            print(f"in flight: {opts.in_flight:,} ({note})", file=sys.stderr)
    elif opts.in_flight > cap:
        raise SystemExit(f"--in-flight {opts.in_flight} needs more than {hard} descriptors")
    work = Path(tempfile.mkdtemp(prefix="gpscale-", dir="/tmp"))
    try:
        result = asyncio.run(cycle(opts, work))
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    mb = result["records_mb"]
    print("| rollouts | in flight (exported) | prepare s | commit s | restore s "
          "| records MB | replacement failures | rewards == 1.0 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {result['rollouts']:,} | {result['in_flight']:,} ({result['exported']:,}) "
        f"| {result['prepare_s']:.2f} | {result['commit_s']:.2f} | {result['restore_s']:.2f} "
        f"| {', '.join(f'{k} {v:.1f}' for k, v in sorted(mb.items()))} "
        f"| {result['replacement_failures']} "
        f"| {result['rollouts'] - result['rewards_not_one'] - result['replacement_failures']:,} |"
    )
    for phase in ("prepare", "commit", "restore"):
        per = result[f"{phase}_by_server_s"]
        print(f"{phase} by server: " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(per.items())))
    print(f"first run {result['first_run_s']} s, replacements {result['replacements_s']} s, "
          f"{os.cpu_count()} cores")  # fmt: skip
    if opts.json:
        print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
