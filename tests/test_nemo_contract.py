"""NeMo Gym's controllers drive gym-proxy unchanged: the Gen-2 control-plane contract,
written from the controller's side with the request bodies NeMo Gym's coordination
(`nemo_gym/_checkpoint/coordination.py`) and NeMo-RL's Gym checkpoint adapter send, and
the reply fields they read."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from gym_proxy.coordinator import checkpoint_files as records
from gym_proxy.coordinator.clients.controller import ControlFailed, Controller, Participant
from gym_proxy.coordinator.contract.episodes import EpisodeId
from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN, Control, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"


def body(checkpoint_id: str, seconds: float = 30, **extra) -> dict:
    """The fields every coordination call carries."""
    return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + seconds, **extra}


async def post(http, url, path, **kwargs):
    async with http.post(f"{url}{path}", **kwargs) as resp:
        return resp.status, await resp.json()


@pytest.fixture
def participant(start_proxy):
    return start_proxy(workers=2, control_token=CONTROL_TOKEN)


async def test_commit_takes_stop_and_answers_capture_keys(in_process, http, tmp_path, test_app):
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=test_app)
    control = Control(http, proxy.url)
    # a resources session seeded under a rollout is bound to its episode
    status, _ = await post(
        http, proxy.url, "/ng-rollout/r1-a2/seed_session", json={"initial_count": 1}
    )
    assert status == 200
    status, _ = await post(http, proxy.url, "/seed_session", json={"initial_count": 4})
    assert status == 200
    assert (await control.ok("prepare", **body("ck")))["phase"] == "prepared"
    scope = [{"rollout_id": "r1", "attempt": 2}]
    reply = await control.ok(
        "commit", **body("ck", checkpoint_dir=str(tmp_path), episode_ids=scope, stop=True)
    )
    assert reply["phase"] == "committed"
    assert reply["episode_ids"] == ["r1-a2"]  # strings, bound sessions included
    # the unbound seed is exported too (a gym-proxy extension), but names no rollout
    assert reply["manifest"]["record_count"] == 2
    stopped = 0
    await control.ok("resume", **body("ck"))
    for worker in (await control.ok("status"))["workers"]:
        async with http.get(f"{proxy.url}/stopped", headers={OWNER: worker["owner"]}) as resp:
            stopped += (await resp.json())["stopped"]
    assert stopped == 2  # every worker's app heard stop


@BOTH_APP_KINDS
async def test_retire_in_restored_drops_the_continuation(start_proxy, http, tmp_path):
    first = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    run = asyncio.ensure_future(
        http.post(f"{first.url}/run", json={"_ng_rollout_id": "r7", "steps": 2, "gate": "g"})
    )
    control = Control(http, first.url)

    async def at_first_boundary():
        async with http.get(f"{first.url}/progress") as resp:
            return (await resp.json())["progress"].get("r7") == 1

    # the proxy counts a request in flight before the worker's app has read its rollout
    # ID: wait for the episode's first boundary, which only the app can reach
    async with http.post(f"{first.url}/release?name=g-0") as resp:
        assert resp.status == 200
    await wait_until(at_first_boundary, 10, "the episode to reach its first boundary")
    reply = await control.checkpoint(
        "ck", str(tmp_path), episode_ids=[{"rollout_id": "r7", "attempt": 0}]
    )
    assert reply["episode_ids"] == ["r7"]
    first.kill_all()
    with pytest.raises(aiohttp.ClientError):
        await run

    second = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, second.url)
    reply = await control.ok(
        "restore",
        **body(
            "rs",
            checkpoint_dir=str(tmp_path),
            episode_ids=[{"rollout_id": "r7", "attempt": 0}],
        ),
    )
    assert reply["restored"] == ["r7-a1"]
    # NeMo-RL's discard_restored: retire the restored attempt before resuming
    reply = await control.ok(
        "retire", **body("rs", episode_ids=[{"rollout_id": "r7", "attempt": 1}])
    )
    assert reply == {"retired": ["r7-a1"]}
    status = await control.ok("status")
    assert status["restored_pending"] == [] and status["retired_rollouts"] == 1
    await control.ok("resume", **body("rs"))
    for attempt in (0, 1):  # refused on every worker until forget
        for worker in status["workers"]:
            code, reply = await post(
                http,
                second.url,
                "/run",
                headers={OWNER: worker["owner"]},
                json={"_ng_rollout_id": "r7", "_ng_attempt_index": attempt, "steps": 0},
            )
            assert (code, reply["error"]["code"]) == (409, "stale_attempt")
    # the rollout starts over as N+2, from its input
    code, reply = await post(
        http, second.url, "/run", json={"_ng_rollout_id": "r7", "_ng_attempt_index": 2, "steps": 1}
    )
    assert code == 200 and reply["restored"] is False
    reply = await control.ok("forget", **body("f1", rollout_ids=["r7"]))
    assert reply == {"forgotten": ["r7"]}
    assert (await control.ok("status"))["retired_rollouts"] == 0
    code, _ = await post(
        http, second.url, "/run", json={"_ng_rollout_id": "r7", "_ng_attempt_index": 1, "steps": 0}
    )
    assert code == 200


async def test_retire_marks_reach_late_workers_and_forget_is_fenced(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    proxy = start_proxy(
        workers=2, control_token=CONTROL_TOKEN, env={"GYM_TEST_HOLD_FILE": str(hold)}
    )
    control = Control(http, proxy.url)
    await control.ok("retire", **body("x1", episode_ids=[{"rollout_id": "gone", "attempt": 3}]))
    victim = (await control.ok("status"))["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)

    async def replaced():
        workers = (await control.ok("status"))["workers"]
        return len(workers) == 2 and victim["owner"] not in {w["owner"] for w in workers}

    await wait_until(replaced, 20, "a replacement worker")
    for worker in (await control.ok("status"))["workers"]:  # the newcomer got the marks
        code, reply = await post(
            http,
            proxy.url,
            "/run",
            headers={OWNER: worker["owner"]},
            json={"_ng_rollout_id": "gone", "_ng_attempt_index": 2},
        )
        assert (code, reply["error"]["code"]) == (409, "stale_attempt"), worker
    await control.ok("prepare", **body("p1"))
    code, reply = await control.call("forget", **body("x2", rollout_ids=["gone"]))
    assert (code, reply["error"]["code"]) == (409, "invalid_phase")
    assert "resume first" in reply["error"]["detail"]
    code, reply = await control.call(
        "retire", **body("x3", episode_ids=[{"rollout_id": "a", "attempt": 0}])
    )
    assert (code, reply["error"]["code"]) == (409, "invalid_phase")
    await control.ok("resume", **body("p1"))
    bads: list[dict[str, Any]] = [
        {"rollout_ids": []},
        {"rollout_ids": ["x-a3"]},
        {"rollout_ids": "gone"},
    ]
    for bad in bads:
        code, reply = await control.call("forget", **body("x4", **bad))
        assert (code, reply["error"]["code"]) == (400, "invalid_request"), bad
    code, reply = await control.call("retire", **body("x5", episode_ids=[]))
    assert (code, reply["error"]["code"]) == (400, "invalid_request")


async def test_blockers_and_markers_are_what_a_controller_acts_on(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    proxy = start_proxy(
        workers=2, control_token=CONTROL_TOKEN, env={"GYM_TEST_HOLD_FILE": str(hold)}
    )
    control = Control(http, proxy.url)
    # an episode inside a `wait` step (between boundaries): it blocks by its bare key
    owner = (await control.ok("status"))["workers"][0]["owner"]
    slow = asyncio.ensure_future(
        http.get(f"{proxy.url}/ng-rollout/slowpoke-a1/slow?seconds=30", headers={OWNER: owner})
    )

    async def arrived():
        async with http.get(f"{proxy.url}/seen", headers={OWNER: owner}) as resp:
            return "/slow" in (await resp.json())["paths"]

    await wait_until(arrived, 10, "the slow step to run on its worker")
    reply = await control.ok("prepare", **body("b1", seconds=1))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["slowpoke-a1"] and reply["report"]["restarts"] == []
    await control.ok("resume", **body("b1"))
    # the straggler policy: resume, retire the blockers by key, prepare again
    participants = [Participant(proxy.url, CONTROL_TOKEN, http)]
    controller = Controller(participants, timeout=5)
    await controller.learn_kinds()
    result = await controller.checkpoint("b1x", str(tmp_path), stragglers="retire")
    assert set(result.committed) == {proxy.url}
    assert [e.key for e in result.retired] == ["slowpoke-a1"] and not result.complete
    async with await slow as resp:
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_attempt"
    # the multi-worker markers
    hold.write_text("hold")
    victim = (await control.ok("status"))["workers"][1]
    await control.ok("prepare", **body("b2"))
    os.kill(victim["pid"], signal.SIGKILL)

    async def markers():
        blockers = (await control.ok("status"))["report"]["blockers"]
        return blockers == ["resources-workers-unreported:1", "resources-worker-lost"]

    await wait_until(markers, 10, "the worker markers")
    await control.ok("resume", **body("b2"))
    hold.unlink()


@BOTH_APP_KINDS
async def test_resume_fencing_as_gen2(participant, http, tmp_path):
    control = Control(http, participant.url)
    # a resume of an unknown ID in idle is remembered: a delayed prepare cannot close admission
    assert await control.ok("resume", **body("aborted")) == {"phase": "idle", "idempotent": True}
    code, reply = await control.call("prepare", **body("aborted"))
    assert (code, reply["error"]["code"]) == (409, "stale_checkpoint")
    prepared = await control.ok("prepare", **body("open"))
    # a resume of an ID already resumed answers idempotently while another is open
    assert await control.ok("resume", **body("aborted")) == {"phase": "idle", "idempotent": True}
    assert (await control.ok("status"))["phase"] == "prepared"
    # a cached reply is returned before the deadline is looked at
    assert (
        await control.ok("prepare", checkpoint_id="open", deadline_ts=time.time() - 5) == prepared
    )
    committed = await control.ok("commit", **body("open", checkpoint_dir=str(tmp_path)))
    again = await control.ok(
        "commit", checkpoint_id="open", deadline_ts=time.time() - 5, checkpoint_dir=str(tmp_path)
    )
    assert again == committed
    code, reply = await control.call("commit", **body("open", checkpoint_dir=str(tmp_path / "x")))
    assert (code, reply["error"]["code"]) == (409, "checkpoint_conflict")  # another directory
    assert (await control.ok("resume", **body("open")))["idempotent"] is False
    assert (await control.ok("resume", **body("open")))["idempotent"] is True


async def test_commit_onto_another_manifest_is_422_and_cleans_up(participant, http, tmp_path):
    control = Control(http, participant.url)
    async with http.post(f"{participant.url}/seed_session", json={"initial_count": 1}) as resp:
        assert resp.status == 200
    await control.checkpoint("first", str(tmp_path))
    await control.ok("resume", **body("first"))
    base = records.checkpoint_path(str(tmp_path), "resources", "apps")
    before = sorted(p.name for p in base.iterdir())
    async with http.post(f"{participant.url}/seed_session", json={"initial_count": 2}) as resp:
        assert resp.status == 200  # different records, so a different records file
    await control.ok("prepare", **body("second"))
    code, reply = await control.call("commit", **body("second", checkpoint_dir=str(tmp_path)))
    assert (code, reply["error"]["code"]) == (422, "invalid_checkpoint_state"), reply
    assert sorted(p.name for p in base.iterdir()) == before  # its records file was deleted
    await control.ok("resume", **body("second"))


def test_identical_commit_returns_the_existing_manifest(tmp_path):
    base = records.checkpoint_path(str(tmp_path), "resources", "inst")
    args: dict[str, Any] = {
        "kind": "resources",
        "instance": "inst",
        "checkpoint_id": "c",
        "records": [{"episode_id": None, "session_id": "s", "state": 1, "owner": None}],
        "extras": {"session_owners": {}, "assigned_sessions": {}, "assigned_app_sessions": {}},
    }
    first = records.write(base, **args)
    assert records.write(base, **args) == first


async def test_restore_failure_retires_the_continuations_and_resumes(start_proxy, http, tmp_path):
    """coordination's restore failure path, through the controller library: one
    participant refuses (a checkpoint of the wrong kind), so the N+1 attempts are retired
    everywhere and everything is resumed."""
    good = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    await Control(http, good.url).checkpoint("ck", str(tmp_path), episode_ids=[])
    good.kill_all()
    res = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    env = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "environment"})
    controller = Controller([Participant(u, CONTROL_TOKEN, http) for u in (res.url, env.url)])
    await controller.learn_kinds()
    with pytest.raises(ControlFailed) as failed:
        await controller.restore("rs", str(tmp_path), [EpisodeId("z", 0)])
    assert failed.value.codes == {"invalid_checkpoint_state"}
    for proxy in (res, env):
        status = await Control(http, proxy.url).ok("status")
        assert status["phase"] == "idle" and status["retired_rollouts"] == 1  # z-a1 retired
