"""The NeMo Gym tier: the released nemo-gym 0.7.0 itself, its own servers unmodified, each
behind its own gym-proxy, wired by NeMo Gym's global config and driven by NeMo Gym's own
rollout collection (tests/nemo_gym_stack.py). It runs in the Python 3.13 virtualenv
`tests/nemo_gym/install.sh` makes (nemo-gym requires 3.13); elsewhere it is skipped."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from tests.nemo_gym import structured  # noqa: E402
from tests.nemo_gym_stack import STRUCTEVAL, NemoStack, counter_rows  # noqa: E402
from tests.support import CONTROL_TOKEN, wait_until  # noqa: E402

ROLLOUTS = 200
CONCURRENCY = 32
WORKERS = {"env": 4, "agent": 4, "resources": 4, "model": 2}


async def every_rollout_right(stack: NemoStack, http: aiohttp.ClientSession) -> None:
    """Start the stack, run the rollouts: every one finishes with reward 1.0."""
    stack.start()
    await stack.wait_serving(http)
    run = stack.start_rollouts(counter_rows(ROLLOUTS), CONCURRENCY).result()
    assert run.failures == [], run.failures[:3]
    assert (run.finished, run.right) == (ROLLOUTS, ROLLOUTS), run.rewards


async def test_the_stack_under_gym_proxy_finishes_every_rollout_right(http, tmp_path):
    """200 rollouts at concurrency 32 through four gym-proxies (4, 4, 4, 2 workers): every
    one finishes with reward 1.0, and every counter session's calls reached one worker
    (the resources workers' own access log says which served what)."""
    stack = NemoStack(tmp_path / "stack", workers=WORKERS)
    try:
        await every_rollout_right(stack, http)
        sessions = stack.sessions_by_worker("resources")
        assert len(sessions) >= ROLLOUTS  # a session per rollout, seen by the workers
        split = {sid: slots for sid, slots in sessions.items() if len(slots) > 1}
        assert not split, f"sessions served by two workers: {list(split.items())[:5]}"
        assert len(set().union(*sessions.values())) == WORKERS["resources"]  # all took part
    finally:
        stack.stop()


async def test_the_reference_one_uvicorn_process_per_server(http, tmp_path):
    """The same stack as NeMo Gym runs it itself (`python app.py`, one uvicorn process per
    server): the reference result the gym-proxy stack must equal."""
    stack = NemoStack(tmp_path / "stack", workers=None)
    try:
        await every_rollout_right(stack, http)
    finally:
        stack.stop()


async def test_a_rolling_restart_of_every_server_mid_collection_loses_no_rollout(http, tmp_path):
    """NeMo Gym's rollout collection runs 100 rollouts; with 32 of them waiting for their
    last model turn, every server of the stack is restarted, worker by worker, at once.
    The counter's sessions (it declares its session dict) move to the replacements while
    they wait; the environment's, the agent's and the model's requests (restart-only
    servers: NeMo Gym's `/run` is not handed over) end where they run once the model
    answers, and their old workers stop then. Every rollout finishes with reward 1.0 and
    no old worker is left."""
    stack = NemoStack(
        tmp_path / "stack",
        workers={"env": 2, "agent": 2, "resources": 2, "model": 2},
        gym_proxy_args={"resources": ["--session-state", "session_id_to_counter"]},
    )
    backend = stack.url("backend")
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}

    async def status(role: str) -> dict:
        url = f"{stack.url(role)}/ng-control/v1/checkpoint/status"
        async with http.get(url, headers=auth) as response:
            return await response.json()

    async def restart(role: str) -> dict:
        url = f"{stack.url(role)}/ng-control/v1/gym-proxy/workers/restart"
        # It ends once the held rollouts are released, after the counter's restart:
        # longer than the client's default 30 s on a slow machine.
        wait = aiohttp.ClientTimeout(total=180)
        body = {"timeout_s": 60, "pause_s": 0}
        async with http.post(url, json=body, headers=auth, timeout=wait) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def held() -> bool:
        async with http.get(f"{backend}/control/held") as response:
            return (await response.json())["held"] == CONCURRENCY

    try:
        stack.start()
        await stack.wait_serving(http)
        async with http.post(f"{backend}/control/hold") as response:
            assert response.status == 200
        rollouts = stack.start_rollouts(counter_rows(100), CONCURRENCY)
        await wait_until(held, 60, "32 rollouts to wait for their last turn")
        roles = ("env", "agent", "resources", "model")
        restarts = {role: asyncio.ensure_future(restart(role)) for role in roles}
        counter = await asyncio.wait_for(restarts["resources"], 120)  # while they wait
        assert counter["complete"] and counter["failed"] == [], counter
        assert counter["moved"] >= CONCURRENCY, counter  # each waiting rollout's session
        async with http.post(f"{backend}/control/release") as response:
            assert response.status == 200
        for role in ("env", "agent", "model"):
            reply = await asyncio.wait_for(restarts[role], 120)
            assert reply["complete"], (role, reply)
            assert [s["outcome"] for s in reply["slots"]] == ["stopped", "stopped"], reply
            for failed in reply["episodes_failed"]:  # restart-only: NeMo Gym's /run ends
                assert failed["reason"].endswith("its episodes run where they are"), failed
        run = rollouts.result()
        assert run.failures == [], run.failures[:3]
        assert (run.finished, run.right) == (100, 100), run.rewards
        for role in roles:
            states = [w["state"] for w in (await status(role))["workers"]]
            assert states == ["ready", "ready"], (role, states)
    finally:
        stack.stop()


async def test_structeval_behind_two_workers_scores_every_long_answer(http, tmp_path):
    """NeMo Gym's released structeval server (the bench's CPU-bound verifier) behind
    gym-proxy with 2 workers, the rest with one: 24 rollouts whose answers are 40-item
    YAML documents all score 1.0, and both workers verified some."""
    stack = NemoStack(
        tmp_path / "stack",
        workers={"env": 1, "agent": 1, "resources": 2, "model": 1},
        specs=STRUCTEVAL,
    )
    try:
        stack.start()
        await stack.wait_serving(http)
        run = stack.start_rollouts(structured.rows(24, items=40), 8).result()
        assert run.failures == [], run.failures[:3]
        assert (run.finished, run.right) == (24, 24), run.rewards
        verified = re.findall(r"worker (\d+) /verify 200", stack.log("resources"))
        assert set(verified) == {"0", "1"} and len(verified) == 24, verified
    finally:
        stack.stop()


async def test_every_gym_proxy_killed_mid_collection_adopts_its_workers(http, tmp_path):
    """NeMo Gym's rollout collection runs 64 rollouts with 32 waiting for their last
    model turn (their counter sessions seeded and incremented) when all four gym-proxies
    are killed (kill -9, the proxies alone) and the same commands started again: they
    adopt the workers, NeMo Gym's clients retry what the crash cut, and every rollout
    finishes with reward 1.0, served by the same worker processes."""
    grace = ["--orphan-grace", "120"]
    stack = NemoStack(
        tmp_path / "stack",
        workers={"env": 2, "agent": 2, "resources": 2, "model": 2},
        gym_proxy_args={
            "resources": ["--session-state", "session_id_to_counter", *grace],
            "env": grace,
            "agent": grace,
            "model": grace,
        },
    )
    backend = stack.url("backend")
    roles = ("env", "agent", "resources", "model")

    async def held() -> bool:
        async with http.get(f"{backend}/control/held") as response:
            return (await response.json())["held"] == CONCURRENCY

    async def worker_pids(role: str) -> set[int]:
        url = f"{stack.url(role)}/ng-control/v1/checkpoint/status"
        auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
        async with aiohttp.ClientSession() as fresh, fresh.get(url, headers=auth) as response:
            return {w["pid"] for w in (await response.json())["workers"]}

    try:
        stack.start()
        await stack.wait_serving(http)
        before = {role: await worker_pids(role) for role in roles}
        async with http.post(f"{backend}/control/hold") as response:
            assert response.status == 200
        rollouts = stack.start_rollouts(counter_rows(64), CONCURRENCY)
        await wait_until(held, 60, "32 rollouts to wait for their last turn")
        for role in roles:  # the proxies alone: their workers go on
            stack.procs[role].kill()
            stack.procs[role].wait(10)
        stack.start(roles=roles)
        async with aiohttp.ClientSession() as fresh:
            await stack.wait_serving(fresh)
        for role in roles:  # adopted: the same processes, no new one
            assert await worker_pids(role) == before[role], role
        async with http.post(f"{backend}/control/release") as response:
            assert response.status == 200
        run = rollouts.result()
        assert run.failures == [], run.failures[:3]
        assert (run.finished, run.right) == (64, 64), run.rewards
    finally:
        stack.stop()
