"""End to end on the reference stack: environment, agent, model and resources servers, each
behind its own gym-proxy, checkpointed together mid-rollout, crashed, restored (onto
other worker counts too) and continued. Every scenario checks that each rollout finished
before the checkpoint or was exported, scores 1.0, ran no step twice past a boundary
(two model calls, one tool call), and that nothing is left on any worker.

`GYM_PROXY_STACK_ROLLOUTS` raises the number of rollouts per scenario (default 16).
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from gym_proxy.coordinator.clients.rollouts import Rollout, exported_rollouts
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.worker.apps.stack import SERVERS, Stack
from tests.ports import free_port
from tests.stack_flow import HOLD_SECOND_CALL, StackRun, all_scored
from tests.support import wait_until

ROLLOUTS = int(os.environ.get("GYM_PROXY_STACK_ROLLOUTS", "16"))
TOKEN = "X-NeMo-Gym-Session-Token"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        connector=aiohttp.TCPConnector(limit=0),
    ) as session:
        yield session


@pytest.fixture
def stacks(tmp_path):
    """Start stacks in this test's directory; each is killed and removed after."""
    made: list[Stack] = []

    def make(workers, env=None) -> Stack:
        # Ports outside the ephemeral range: the stack restarts on them after a crash.
        ports = [free_port() for _ in SERVERS]
        stack = Stack(workers, str(tmp_path / f"stack{len(made)}"), env=env, ports=ports)
        made.append(stack)
        return stack.start()

    yield make
    for stack in made:
        stack.kill()
        stack.remove()


def hold_file(tmp_path, name: str = "hold-model") -> str:
    """A hold switch's file, switched on."""
    path = str(tmp_path / name)
    switch_on(path)
    return path


def switch_on(path: str) -> None:
    with open(path, "w") as switch:
        switch.write("hold")


async def crash_mid_rollout(run: StackRun, rollouts, directory: str, checkpoint_id: str):
    """Start the rollouts, wait until all of them are held at the model (mid-turn),
    checkpoint, crash. Returns what the commit exported."""
    running = asyncio.ensure_future(run.driver.run(rollouts))
    await run.wait_held("model", len(rollouts), running=running)
    exported = await run.checkpoint(checkpoint_id, directory)
    await run.crash(running)
    return exported


@pytest.mark.parametrize(
    ("before", "after"),
    [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4)],
    ids=["1->1", "2->2", "1->2", "2->1", "2->4"],
)
async def test_native_rollouts_crash_and_continue(stacks, http, tmp_path, before, after):
    hold = hold_file(tmp_path)
    run = StackRun(stacks(before, env=HOLD_SECOND_CALL(hold)), http)
    rollouts = run.rollouts(ROLLOUTS, prompt_bytes=2000)  # a system prompt, as the scale run
    exported = await crash_mid_rollout(run, rollouts, str(tmp_path / "ck"), "ck1")
    assert set(exported) == {r.rollout_id for r in rollouts}  # every one was in flight
    os.unlink(hold)
    await run.restore("ck1", str(tmp_path / "ck"), workers=after)
    await run.continue_rollouts(rollouts)
    all_scored(rollouts, lambda r: r.attempt == 1)
    await run.nothing_left_behind()


@pytest.mark.parametrize("workers", [1, 2])
async def test_legacy_agent_run_crash_and_continue(stacks, http, tmp_path, workers):
    hold = hold_file(tmp_path)
    run = StackRun(stacks(workers, env=HOLD_SECOND_CALL(hold)), http, entry="agent")
    rollouts = run.rollouts(ROLLOUTS // 2, prompt_bytes=2000)
    exported = await crash_mid_rollout(run, rollouts, str(tmp_path / "ck"), "legacy")
    assert set(exported) == {r.rollout_id for r in rollouts}
    os.unlink(hold)
    await run.restore("legacy", str(tmp_path / "ck"))
    await run.continue_rollouts(rollouts)
    all_scored(rollouts)
    await run.nothing_left_behind()


async def test_a_second_crash_before_the_replacements_start(stacks, http, tmp_path):
    hold = hold_file(tmp_path)
    run = StackRun(stacks(2, env=HOLD_SECOND_CALL(hold)), http)
    rollouts = run.rollouts(8)
    await crash_mid_rollout(run, rollouts, str(tmp_path / "ck"), "twice")
    os.unlink(hold)
    await run.restore("twice", str(tmp_path / "ck"), resume=False)
    await run.crash()  # restored, not resumed, nothing sent yet: crash again
    await run.restore("twice", str(tmp_path / "ck"), workers=1)
    await run.continue_rollouts(rollouts)
    all_scored(rollouts)
    await run.nothing_left_behind()


async def test_restore_the_same_checkpoint_after_the_replacements_made_calls(
    stacks, http, tmp_path
):
    hold = hold_file(tmp_path)
    run = StackRun(stacks(2, env=HOLD_SECOND_CALL(hold)), http)
    rollouts = run.rollouts(8)
    await crash_mid_rollout(run, rollouts, str(tmp_path / "ck"), "again")
    # the replacements run until the model holds their call again, then all is lost
    await run.restore("again", str(tmp_path / "ck"))
    replacements = asyncio.ensure_future(run.continue_rollouts(rollouts))
    await run.wait_held("model", len(rollouts), running=replacements)
    await run.crash(replacements)
    os.unlink(hold)
    await run.restore("again", str(tmp_path / "ck"), workers=2)
    for rollout in rollouts:
        rollout.attempt -= 1  # the same checkpoint: its attempts continue as N+1 again
    await run.continue_rollouts(rollouts)
    all_scored(rollouts, lambda r: r.attempt == 1)
    await run.nothing_left_behind()


async def test_an_episode_that_finishes_during_prepare_is_neither_lost_nor_run_again(
    stacks, http, tmp_path
):
    model_hold, verify_hold = hold_file(tmp_path), hold_file(tmp_path, "hold-verify")
    env = {
        **HOLD_SECOND_CALL(model_hold),
        "GYM_FAKE_MODEL_HOLD_CITIES": "Oslo,Lima,Cairo,Perth",  # not Riga
        "GYM_WEATHER_HOLD_FILE": verify_hold,
    }
    run = StackRun(stacks(2, env=env), http)
    # `finishing` (Riga) gets through its turn, then waits in its verify step (after its
    # last boundary); the others are held at the model
    finishing, held = [Rollout("late0", {"city": "Riga"})], run.rollouts(4, "held")
    first = asyncio.ensure_future(run.driver.run(finishing))
    others = asyncio.ensure_future(run.driver.run(held))
    await run.wait_held("weather", 1)
    await run.wait_held("model", len(held))
    controller = await run.controller()
    preparing = asyncio.ensure_future(controller.prepare("during"))

    async def blocked_by_the_verify_step() -> bool:
        status = await run.status("env")
        return status["phase"] == "preparing" and status["report"]["blockers"] == ["late0"]

    await wait_until(blocked_by_the_verify_step, 30, "the environment's prepare to wait")
    os.unlink(verify_hold)  # the episode ends while the environment is being prepared
    result = await preparing
    assert result.prepared, result.blockers()
    await first
    assert finishing[0].finished and finishing[0].reply["reward"] == 1.0
    run.exported = exported_rollouts(await controller.commit("during", str(tmp_path / "ck")))
    assert "late0" not in run.exported and set(run.exported) == {r.rollout_id for r in held}
    await run.crash(others)
    os.unlink(model_hold)
    await run.restore("during", str(tmp_path / "ck"))
    await run.continue_rollouts(finishing + held)  # the finished one is not sent again
    assert [attempt for attempt, _, _ in finishing[0].history] == [0]
    all_scored(finishing + held)
    await run.nothing_left_behind()


async def test_a_retired_episode_leaves_nothing_and_its_late_calls_are_refused(
    stacks, http, tmp_path
):
    hold = hold_file(tmp_path)
    run = StackRun(stacks(2, env=HOLD_SECOND_CALL(hold)), http)
    rollouts = run.rollouts(4)
    await crash_mid_rollout(run, rollouts, str(tmp_path / "ck"), "ret")
    os.unlink(hold)
    await run.restore("ret", str(tmp_path / "ck"), resume=False)
    controller = await run.controller()
    doomed = rollouts[0]
    # NeMo-RL discards a restored attempt before resume: retire N+1 everywhere
    await controller.retire("ret", [EpisodeId(doomed.rollout_id, 1)])
    await controller.resume("ret")
    keep = rollouts[1:]
    await run.continue_rollouts(keep)
    all_scored(keep)
    for attempt in (0, 1):  # a late call of the retired attempt (or an older one)
        doomed.attempt = attempt
        await run.driver.dispatch(doomed)
        assert doomed.status == 409 and doomed.reply["error"]["code"] == "stale_attempt"
    await controller.forget("ret", [doomed.rollout_id])
    await run.nothing_left_behind()


async def test_mcp_style_tool_calls_wait_out_a_checkpoint_and_keep_their_sessions(
    stacks, http, tmp_path
):
    run = StackRun(stacks(2), http)
    weather = run.stack.urls["weather"]
    tokens = []
    for _ in range(6):
        async with http.post(f"{weather}/seed_session", json={}) as resp:
            tokens.append(resp.headers[TOKEN])

    async def tool_call(token: str, city: str) -> dict:
        async with http.post(
            f"{weather}/get_weather", json={"city": city}, headers={TOKEN: token}
        ) as resp:
            assert resp.status == 200
            return await resp.json()

    owners = {t: (await tool_call(t, "Oslo"))["served_by"] for t in tokens}
    assert len(set(owners.values())) == 2
    controller = await run.controller()
    assert (await controller.prepare("mcp")).prepared
    waiting = [asyncio.ensure_future(tool_call(t, "Lima")) for t in tokens]

    async def at_the_door() -> bool:
        return (await run.status("weather"))["report"]["counts"].get("door") == len(tokens)

    await wait_until(at_the_door, 30, "the tool calls to wait at their workers' doors")
    assert not any(call.done() for call in waiting)
    await controller.resume("mcp")
    for token, call in zip(tokens, waiting, strict=True):
        assert (await call)["served_by"] == owners[token]
    # commit, crash, restore onto 3 workers: the sessions and their state continue
    assert (await controller.prepare("mcp2")).prepared
    await controller.commit("mcp2", str(tmp_path / "ck"))
    await run.crash()
    await run.restore("mcp2", str(tmp_path / "ck"), workers={"weather": 3})
    for token in tokens:
        await tool_call(token, "Oslo")
        async with http.post(
            f"{weather}/verify", json={"city": "Oslo", "answer": "x"}, headers={TOKEN: token}
        ) as resp:
            assert (await resp.json())["tool_calls"] == 3  # two before the crash, one after
    await run.nothing_left_behind()


async def test_a_rolling_restart_of_the_environment_hands_its_episodes_over(stacks, http, tmp_path):
    """Rollouts held at the model mid-turn: the environment's episodes wait inside their
    agent-turn replay step. A rolling restart of the environment waits for each step to
    end (the hold lifted), hands the episodes over at the boundary after it, and the new
    workers finish them: every rollout scores, answered once, no step run twice past a
    boundary (the agent answers the repeated turn from its session)."""
    hold = hold_file(tmp_path)
    run = StackRun(stacks({"env": 2}, env=HOLD_SECOND_CALL(hold)), http)
    rollouts = run.rollouts(ROLLOUTS)
    running = asyncio.ensure_future(run.driver.run(rollouts))
    await run.wait_held("model", len(rollouts), running=running)
    env = run.stack.urls["env"]
    headers = {"Authorization": f"Bearer {run.stack.control_token}"}
    body = {"timeout_s": 60, "pause_s": 0}

    async def restart() -> dict:
        url = f"{env}/ng-control/v1/gym-proxy/workers/restart"
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == 200
            return await response.json()

    restarting = asyncio.ensure_future(restart())

    async def handing_over() -> bool:  # the workers were asked to park their episodes
        running = (await run.status("env"))["operations"]["running"]
        return running is not None and running["step"] == "handing_over"

    await wait_until(handing_over, 30, "the environment's hand-over to begin")
    os.unlink(hold)  # the model answers: each turn ends, and its episode parks after it
    reply = await restarting
    assert reply["complete"] and reply["episodes_failed"] == [], reply
    assert reply["episodes_moved"] >= 1, reply
    await asyncio.wait_for(running, 120)
    all_scored(rollouts)
    assert all(len(r.history) == 1 for r in rollouts), [r.history for r in rollouts]
    await run.nothing_left_behind()
