"""Running `/run` episodes handed over between workers (`proxy.fleet.moves.handovers`,
`worker.handovers`), gym-proxy in process (`tests/in_process.py`) except where a process
dies: a rolling restart, a drain and a shrink move a
long episode at its boundary; its client's one request is answered by the new worker,
and every step ran exactly once (the episode's log is carried in its boundary state)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN as CONTROL
from tests.support import Control, wait_until
from tests.test_live_operations import TOKEN_HEADER, operate, seed, status_of, whoami
from tests.test_metrics import metrics_url
from tests.test_move_crashes import failpoint

OWNER_HEADER = "x-ng-session-owner"


def run_body(rollout: str, steps: int, pause: float = 0.0, gate: str | None = None) -> dict:
    body: dict = {"_ng_rollout_id": rollout, "steps": steps, "pause": pause}
    if gate is not None:
        body["gate"] = gate
    return body


def log_of(rollout: str, steps: int) -> list[str]:
    return [f"{rollout}:{i}" for i in range(steps)]


async def progress(http: aiohttp.ClientSession, url: str, token: str | None = None) -> dict:
    headers = {TOKEN_HEADER: token} if token else {}
    async with http.get(f"{url}/progress", headers=headers) as response:
        assert response.status == 200
        return (await response.json())["progress"]


async def start_run(http: aiohttp.ClientSession, url: str, body: dict, **kw) -> asyncio.Task:
    async def run() -> tuple[int, dict]:
        async with http.post(f"{url}/run", json=body, **kw) as response:
            return response.status, await response.json()

    return asyncio.ensure_future(run())


async def until_step(
    http: aiohttp.ClientSession, url: str, rollout: str, step: int, token: str | None = None
) -> None:
    async def reached() -> bool:
        return (await progress(http, url, token)).get(rollout, 0) >= step

    await wait_until(reached, 20, f"{rollout} to reach step {step}")


@BOTH_APP_KINDS
async def test_a_restart_hands_a_running_episode_to_the_replacement(in_process, test_app):
    """One worker, an episode of 40 steps of 50 ms running: the restart parks it at its
    next boundary, the replacement continues it, the client's request is answered once,
    by the replacement, with each step done once; the old worker stops at once. (The
    replacement boots while the episode runs on: milliseconds in process, so 2 s of
    steps is ample.)"""
    proxy = await in_process(
        "--metrics", "127.0.0.1:0", workers=1, control_token=CONTROL, app=test_app
    )
    (old,) = proxy.worker_pids()
    async with aiohttp.ClientSession() as http:
        run = await start_run(http, proxy.url, run_body("ep-r", 40, pause=0.05))
        await until_step(http, proxy.url, "ep-r", 3)
        status, reply = await operate(http, proxy.url, "restart", timeout_s=10)
        assert status == 200 and reply["complete"], reply
        assert reply["episodes_moved"] == 1 and reply["episodes_failed"] == [], reply
        (slot,) = reply["slots"]
        assert slot["outcome"] == "stopped", slot
        code, answer = await asyncio.wait_for(run, 30)
        assert code == 200, answer
        assert answer["owner"] == slot["new_owner"] != slot["old_owner"], answer
        assert answer["restored"] is True and answer["state"]["log"] == log_of("ep-r", 40)
        assert old not in proxy.worker_pids()
        async with http.get(metrics_url(proxy)) as response:
            text = await response.text()
        assert "gym_proxy_episodes_handed_over_total 1.0" in text
        assert "gym_proxy_episode_handover_failures_total 0.0" in text


@BOTH_APP_KINDS
async def test_an_episode_in_a_replay_step_moves_as_the_step_ends(in_process, test_app):
    """An episode waits inside a replay step (a gate): it is not handed over mid-step
    (its callee would run the step twice at once); once the gate opens on the old worker
    it parks, is handed over, and the replacement runs the step again (its own gate),
    so the step is in the log once."""
    proxy = await in_process(workers=1, control_token=CONTROL, app=test_app)
    (old,) = proxy.worker_pids()
    async with aiohttp.ClientSession() as http:
        old_owner = (await status_of(http, proxy.url))["workers"][0]["owner"]
        run = await start_run(http, proxy.url, run_body("ep-g", 3, gate="g"))
        await until_step(http, proxy.url, "ep-g", 0)
        restart = asyncio.ensure_future(operate(http, proxy.url, "restart", timeout_s=20))
        # The step says so once the old worker was asked to park the episode.
        await wait_until(lambda: handing_over(http, proxy.url), 20, "the hand-over to begin")
        assert not restart.done()  # the episode is still inside its step
        await release(http, proxy.url, "g-0", old_owner)  # the step ends on the old worker
        status, reply = await restart
        assert status == 200 and reply["complete"] and reply["episodes_moved"] == 1, reply
        assert old not in proxy.worker_pids()
        for i in range(3):
            await release(http, proxy.url, f"g-{i}")
            await until_step(http, proxy.url, "ep-g", i + 1)
        code, answer = await asyncio.wait_for(run, 30)
        assert code == 200 and answer["owner"] == reply["slots"][0]["new_owner"], answer
        assert answer["state"]["log"] == log_of("ep-g", 3), answer


async def handing_over(http: aiohttp.ClientSession, url: str) -> bool:
    running = (await status_of(http, url))["operations"]["running"]
    return (
        running is not None
        and running["step"] == "handing_over"
        and running["detail"].endswith("handing over 1 running episodes")
    )


@BOTH_APP_KINDS
async def test_a_drain_hands_episodes_and_their_sessions_to_the_other_worker(in_process, test_app):
    """Episodes that came under a session of the drained worker move with it: the
    session then answers from the other worker and the episode's answer too."""
    proxy = await in_process(workers=2, control_token=CONTROL, app=test_app)
    async with aiohttp.ClientSession() as http:
        tokens: dict[int, list[str]] = {0: [], 1: []}
        while len(tokens[0]) < 3:
            token = await seed(http, proxy.url)
            tokens[(await whoami(http, proxy.url, token))["slot"]].append(token)
        runs = [
            await start_run(
                http, proxy.url, run_body(f"ep-d{i}", 30, 0.05), headers={TOKEN_HEADER: t}
            )
            for i, t in enumerate(tokens[0])
        ]
        for i in range(3):
            await until_step(http, proxy.url, f"ep-d{i}", 2, tokens[0][0])
        status, reply = await operate(http, proxy.url, "drain", slot=0, timeout_s=10)
        assert status == 200 and reply["complete"], reply
        assert reply["episodes_moved"] == 3 and reply["moved"] == 0, reply
        other = (await status_of(http, proxy.url))["workers"][1]["owner"]
        for token in tokens[0]:
            assert (await whoami(http, proxy.url, token))["owner"] == other
        for i, run in enumerate(runs):
            code, answer = await asyncio.wait_for(run, 30)
            assert code == 200 and answer["owner"] == other, answer
            assert answer["state"]["log"] == log_of(f"ep-d{i}", 30), answer


async def test_an_episode_that_reaches_no_boundary_in_time_is_handed_over_later(
    in_process, test_app
):
    """A step runs past the restart's timeout (and its last sweep): the episode is not
    handed over then (reported, with why), the old worker is left serving it, and the
    background retire parks it at its next boundary and hands it over: its client is
    answered by the replacement, each step done once, and the old worker stops."""
    proxy = await in_process(workers=1, control_token=CONTROL, app=test_app)
    (old,) = proxy.worker_pids()
    async with aiohttp.ClientSession() as http:
        # 15 s: past the replacement's boot, the 0.2 s timeout, the 5 s last sweep and the
        # background retire's first look, on a busy machine too (7.5 s once ran out).
        run = await start_run(http, proxy.url, run_body("ep-slow", 1, pause=15))
        await wait_until(lambda: _in_flight(http, proxy.url), 10, "the episode to be running")
        status, reply = await operate(http, proxy.url, "restart", timeout_s=0.2)
        assert status == 200 and not reply["complete"], reply
        assert reply["episodes_moved"] == 0, reply
        (failed,) = reply["episodes_failed"]
        assert failed["episode"] == "ep-slow", failed
        assert "did not reach a boundary in time" in failed["reason"], failed
        (slot,) = reply["slots"]
        assert slot["outcome"] == "left serving what it holds; decommissioned when it can be", slot
        code, answer = await asyncio.wait_for(run, 30)
        assert code == 200 and answer["owner"] == slot["new_owner"], answer
        assert answer["restored"] is True and answer["state"]["log"] == log_of("ep-slow", 1)

        # The old worker exits inside the background decommission, before it records
        # itself last.
        async def decommissioned() -> bool:
            last = (await status_of(http, proxy.url))["operations"]["last"]
            return last is not None and last["operation"] == "decommission"

        await wait_until(decommissioned, 30, "the background decommission to end")
        last = (await status_of(http, proxy.url))["operations"]["last"]
        assert last["episodes_moved"] == 1 and last["slots"][0]["outcome"] == "stopped", last
        assert old not in proxy.worker_pids()


async def _in_flight(http: aiohttp.ClientSession, url: str) -> bool:
    return (await status_of(http, url))["workers"][0]["in_flight"] == 1


@pytest.mark.parametrize("test_app", ["tests.apps:create_app"], indirect=True)
async def test_the_source_dies_after_giving_the_episode_up(start_proxy):
    """kill -9 of the old worker right after it answered the hand-over markers: the
    request is already on its way to the replacement, which finishes the episode."""
    proxy = start_proxy(workers=1, control_token=CONTROL, env=failpoint("worker-gave-up"))
    async with aiohttp.ClientSession() as http:
        old_owner = (await status_of(http, proxy.url))["workers"][0]["owner"]
        # Gated, not timed: the episode is still running whenever the replacement is up.
        run = await start_run(http, proxy.url, run_body("ep-k", 3, gate="k"))
        await until_step(http, proxy.url, "ep-k", 0)
        restart = asyncio.ensure_future(operate(http, proxy.url, "restart", timeout_s=20))
        await wait_until(lambda: handing_over(http, proxy.url), 20, "the hand-over to begin")
        await release(http, proxy.url, "k-0", old_owner)  # it parks, gives up, is killed
        status, reply = await restart
        assert status == 200 and reply["episodes_moved"] == 1, reply
        for i in range(3):
            await release(http, proxy.url, f"k-{i}")
            await until_step(http, proxy.url, "ep-k", i + 1)
        code, answer = await asyncio.wait_for(run, 30)
        assert code == 200 and answer["pid"] == reply["slots"][0]["new_pid"], answer
        assert answer["state"]["log"] == log_of("ep-k", 3), answer


async def release(
    http: aiohttp.ClientSession, url: str, name: str, owner: str | None = None
) -> None:
    """Open a gate of the test app's /run (on `owner`'s worker, or the only one)."""
    headers = {OWNER_HEADER: owner} if owner else {}
    async with http.post(f"{url}/release?name={name}", headers=headers) as response:
        assert response.status == 200


@pytest.mark.parametrize("test_app", ["tests.apps:create_app"], indirect=True)
@pytest.mark.parametrize("point", ["handover-before-receive", "handover-given-up"])
async def test_the_proxy_dies_mid_hand_over_and_the_checkpoint_restores(
    start_proxy, tmp_path, point
):
    """The proxy dies (its workers with it) after the source parked the episode, or after
    it gave the request back: the checkpoint committed before is whole, and a restore
    continues the episode as attempt 1 from its committed boundary: each step is in the
    log once, the committed ones under attempt 0."""
    first = start_proxy(workers=1, control_token=CONTROL, env=failpoint(point))
    async with aiohttp.ClientSession() as http:
        body = run_body("ep-c", 60, pause=0.05)
        run = await start_run(http, first.url, body)
        await until_step(http, first.url, "ep-c", 2)
        control = Control(http, first.url)
        committed = await control.checkpoint("ck", str(tmp_path))
        assert committed["episode_ids"] == ["ep-c"], committed
        await control.ok("resume", checkpoint_id="ck")
        with pytest.raises(aiohttp.ClientError):
            await operate(http, first.url, "restart", timeout_s=10)
        assert first.wait_exit(30) == 97
        with pytest.raises(aiohttp.ClientError):
            await run
        second = start_proxy(workers=2, control_token=CONTROL)
        control = Control(http, second.url)
        episode = {"rollout_id": "ep-c", "attempt": 0}
        await control.ok(
            "restore", checkpoint_id="rs", checkpoint_dir=str(tmp_path), episode_ids=[episode]
        )
        await control.ok("resume", checkpoint_id="rs")
        again = await start_run(http, second.url, {**body, "_ng_attempt_index": 1})
        code, answer = await asyncio.wait_for(again, 30)
        assert code == 200 and answer["restored"] is True, answer
        log = answer["state"]["log"]
        assert [int(entry.split(":")[1]) for entry in log] == list(range(60)), log
        keys = [entry.split(":")[0] for entry in log]
        first_new = keys.index("ep-c-a1")
        assert first_new >= 2 and keys == ["ep-c"] * first_new + ["ep-c-a1"] * (60 - first_new)


@pytest.mark.parametrize("test_app", ["tests.apps:create_app"], indirect=True)
async def test_the_target_dies_after_taking_the_episode_and_it_goes_on_at_the_source(
    start_proxy,
):
    """kill -9 of the target right after it installed the hand-over: the source was not
    told to give the episode up, so it goes on there; its client is answered once, by
    the source, each step done once."""
    proxy = start_proxy(workers=2, control_token=CONTROL, env=failpoint("worker-installed"))
    async with aiohttp.ClientSession() as http:
        token = await seed(http, proxy.url)
        where = await whoami(http, proxy.url, token)
        run = await start_run(
            http, proxy.url, run_body("ep-t", 30, pause=0.05), headers={TOKEN_HEADER: token}
        )
        await until_step(http, proxy.url, "ep-t", 2, token)
        status, reply = await operate(http, proxy.url, "drain", slot=where["slot"], timeout_s=10)
        assert status == 200 and reply["episodes_moved"] == 0, reply
        (failed,) = reply["episodes_failed"]
        assert failed["episode"] == "ep-t" and "did not take it" in failed["reason"], failed
        code, answer = await asyncio.wait_for(run, 30)
        assert code == 200 and answer["pid"] == where["pid"], answer
        assert answer["restored"] is False and answer["state"]["log"] == log_of("ep-t", 30)
