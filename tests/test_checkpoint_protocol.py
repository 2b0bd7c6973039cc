"""The control plane's contract, against real processes.

Both app kinds (BOTH_APP_KINDS: the aiohttp door and the ASGI door) run the tests where
a worker's door is on the path: new work waiting at the door, a request in flight, a
lost worker, the lease's reopen, a retired attempt's cancel. What the coordinator decides
before any worker is asked (a missing worker, conflicts and stale IDs, auth and bodies,
a damaged or half-written checkpoint) runs once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import orjson
import pytest

from gym_proxy.coordinator import checkpoint_files as records
from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN, Control, ProxyProcess, app_saw, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"


@pytest.fixture
def participant(start_proxy):
    return start_proxy(workers=2, control_token=CONTROL_TOKEN)


async def new_session(http, url, count=0):
    async with http.post(f"{url}/seed_session", json={"initial_count": count}) as resp:
        assert resp.status == 200
        return resp.headers[TOKEN]


@BOTH_APP_KINDS
async def test_session_calls_and_new_work_wait_at_the_door(participant, http):
    """NeMo Gym's clients do not repeat a refused call, so while a checkpoint is open
    nothing is refused: a call on a session, a new seed and a new episode all wait at the
    door (which counts as ready: none of them has started) and go on after resume."""
    control = Control(http, participant.url)
    token = await new_session(http, participant.url, 5)
    await control.ok("prepare", checkpoint_id="door")
    waiting = asyncio.ensure_future(
        http.post(f"{participant.url}/increment_counter", json={"count": 1}, headers={TOKEN: token})
    )
    seeding = asyncio.ensure_future(
        http.post(f"{participant.url}/seed_session", json={"initial_count": 1})
    )
    running = asyncio.ensure_future(
        http.post(f"{participant.url}/run", json={"_ng_rollout_id": "new", "steps": 1})
    )

    async def at_door():
        status = await control.ok("status")
        return status["report"]["counts"].get("door") == 3

    await wait_until(at_door, 10, "the three calls to wait at the door")
    assert (await control.ok("status"))["report"]["ready"] is True  # a door wait is ready
    assert not waiting.done() and not seeding.done() and not running.done()
    await control.ok("resume", checkpoint_id="door")
    resp = await asyncio.wait_for(waiting, 10)
    assert (await resp.json())["count"] == 6
    resp = await asyncio.wait_for(seeding, 10)
    await resp.read()  # an unread response keeps its connection past the session's close
    assert resp.status == 200
    resp = await asyncio.wait_for(running, 10)
    assert resp.status == 200 and (await resp.json())["key"] == "new"


@BOTH_APP_KINDS
async def test_other_kinds_hold_new_sessions_at_the_door_too(start_proxy, http):
    proxy = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "agent"})
    control = Control(http, proxy.url)
    assert (await control.ok("status"))["kind"] == "agent"
    await control.ok("prepare", checkpoint_id="door")
    seeding = asyncio.ensure_future(http.post(f"{proxy.url}/seed_session", json={}))

    async def at_door():
        return (await control.ok("status"))["report"]["counts"].get("door") == 1

    await wait_until(at_door, 10, "the seed to wait at the door")
    await control.ok("resume", checkpoint_id="door")
    resp = await asyncio.wait_for(seeding, 10)
    await resp.read()  # an unread response keeps its connection past the session's close
    assert resp.status == 200


@BOTH_APP_KINDS
async def test_in_flight_request_blocks_until_done(participant, http):
    control = Control(http, participant.url)
    token = await new_session(http, participant.url)
    slow = asyncio.ensure_future(
        http.get(f"{participant.url}/slow?seconds=3", headers={TOKEN: token})
    )
    sid = token.split(".")[-3]

    # In the app, not only forwarded (`app_saw`; CI once saw "prepared" here).
    await wait_until(lambda: app_saw(http, participant.url, token, "/slow"), 10, "/slow to run")
    reply = await control.ok("prepare", checkpoint_id="busy", deadline_ts=time.time() + 0.5)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == [f"session:{sid}"]
    assert reply["report"]["blocker_count"] == 1
    status, body = await control.call("commit", checkpoint_id="busy", checkpoint_dir="/tmp/x")
    assert status == 409 and body["error"]["code"] == "invalid_phase"
    async with await slow as resp:
        assert resp.status == 200
    reply = await control.ok("prepare", checkpoint_id="busy")
    assert reply["phase"] == "prepared"
    await control.ok("resume", checkpoint_id="busy")


@BOTH_APP_KINDS
async def test_a_stop_answers_what_waits_for_an_open_checkpoint(start_proxy, http):
    """SIGTERM while a checkpoint is open: no resume can come, so an episode parked at its
    boundary and a call waiting at the door are answered 503 `server_stopping` at once
    (they waited out --graceful-timeout, then were cut), and the stop goes on."""
    proxy = start_proxy("--graceful-timeout", "300", workers=1, control_token=CONTROL_TOKEN)
    control = Control(http, proxy.url)
    token = await new_session(http, proxy.url)
    run = asyncio.ensure_future(
        http.post(f"{proxy.url}/run", json={"_ng_rollout_id": "ep", "steps": 2, "pause": 0.2})
    )
    await wait_until(lambda: app_saw(http, proxy.url, token, "/run"), 10, "the episode to run")
    assert (await control.ok("prepare", checkpoint_id="ck-stop"))["phase"] == "prepared"
    call = asyncio.ensure_future(
        http.post(f"{proxy.url}/increment_counter", json={"count": 1}, headers={TOKEN: token})
    )

    async def door_and_parked():
        counts = (await control.ok("status"))["report"]["counts"]
        return (counts.get("door"), counts.get("parked")) == (1, 1)

    await wait_until(door_and_parked, 10, "a call at the door and an episode parked")
    proxy.signal(signal.SIGTERM)
    stopping = "gym-proxy is stopping while checkpoint ck-stop is open: this call "
    for waiting, why in ((call, "waited at the door and did not start"),
                         (run, "was parked for the checkpoint and goes no further")):  # fmt: skip
        async with await asyncio.wait_for(waiting, 30) as resp:
            assert resp.status == 503, await resp.text()
            error = (await resp.json())["error"]
            assert error == {"code": "server_stopping", "detail": stopping + why}, error
    assert await asyncio.to_thread(proxy.wait_exit, 30) == 0
    assert "stopping with checkpoint ck-stop open" in proxy.log(), proxy.log()


@BOTH_APP_KINDS
async def test_lost_worker_blocks_until_resume(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    control, status = await _held_participant(start_proxy, http, hold)
    await control.ok("prepare", checkpoint_id="lost")
    hold.write_text("keep the replacement from registering")
    os.kill(status["workers"][0]["pid"], signal.SIGKILL)

    await wait_until(
        lambda: _has_blocker(control, "resources-worker-lost"), 10, "worker-lost in the blockers"
    )
    # prepared no more: a retried prepare waits again and reports the loss
    reply = await control.ok("prepare", checkpoint_id="lost", deadline_ts=time.time() + 0.5)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == [
        "resources-workers-unreported:1",
        "resources-worker-lost",
    ]
    code, body = await control.call("commit", checkpoint_id="lost", checkpoint_dir=str(tmp_path))
    assert (code, body["error"]["code"]) == (409, "invalid_phase")  # not prepared
    hold.unlink()
    await wait_until(lambda: _live_workers(control, 2), 20, "the slot to come back")
    assert await _has_blocker(control, "resources-worker-lost")  # still blocked until resume
    reply = await control.ok("prepare", checkpoint_id="lost", deadline_ts=time.time() + 0.5)
    assert reply["phase"] == "preparing" and "resources-worker-lost" in reply["report"]["blockers"]
    await control.ok("resume", checkpoint_id="lost")
    reply = await control.ok("prepare", checkpoint_id="after")
    assert reply["phase"] == "prepared"
    await control.ok("resume", checkpoint_id="after")


async def _has_blocker(control, name):
    return name in (await control.ok("status"))["report"]["blockers"]


async def _live_workers(control, count):
    return len((await control.ok("status"))["workers"]) == count


async def _in_flight(control, count):
    return sum(w["in_flight"] for w in (await control.ok("status"))["workers"]) == count


async def _held_participant(start_proxy, http, hold):
    """Two workers whose replacements wait while `hold` exists; returns (control, status)."""
    proxy = start_proxy(
        workers=2, control_token=CONTROL_TOKEN, env={"GYM_TEST_HOLD_FILE": str(hold)}
    )
    control = Control(http, proxy.url)
    return control, await control.ok("status")


async def test_missing_worker_blocks_prepare(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    control, status = await _held_participant(start_proxy, http, hold)
    hold.write_text("hold")
    os.kill(status["workers"][1]["pid"], signal.SIGKILL)
    await wait_until(lambda: _live_workers(control, 1), 10, "the worker to be gone")
    reply = await control.ok("prepare", checkpoint_id="short", deadline_ts=time.time() + 0.5)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["resources-workers-unreported:1"]
    await control.ok("resume", checkpoint_id="short")
    hold.unlink()


async def test_retries_conflicts_and_stale_ids(participant, http, tmp_path):
    control = Control(http, participant.url)
    await new_session(http, participant.url)
    first = await control.ok("prepare", checkpoint_id="a")
    assert await control.ok("prepare", checkpoint_id="a") == first
    code, body = await control.call("prepare", checkpoint_id="b")
    assert code == 409 and body["error"]["code"] == "checkpoint_conflict"
    committed = await control.ok("commit", checkpoint_id="a", checkpoint_dir=str(tmp_path))
    again = await control.ok("commit", checkpoint_id="a", checkpoint_dir=str(tmp_path))
    assert again == committed  # the cached reply, not a second manifest
    assert (await control.ok("resume", checkpoint_id="a")) == {"phase": "idle", "idempotent": False}
    assert (await control.ok("resume", checkpoint_id="a"))["idempotent"] is True
    for op, extra in (("prepare", {}), ("commit", {"checkpoint_dir": str(tmp_path)})):
        code, body = await control.call(op, checkpoint_id="a", **extra)
        assert code == 409 and body["error"]["code"] == "stale_checkpoint", op
    code, body = await control.call("commit", checkpoint_id="zz", checkpoint_dir="/tmp")
    assert code == 409 and body["error"]["code"] == "invalid_phase"
    code, body = await control.call(
        "retire",
        checkpoint_id="late",
        deadline_ts=time.time() - 1,
        episode_ids=[{"rollout_id": "r", "attempt": 0}],
    )
    assert code == 409 and body["error"]["code"] == "deadline_exceeded"
    # a prepare whose deadline passed closes admission and answers at once (Gen-2): the
    # controller resumes or retries
    late = await control.ok("prepare", checkpoint_id="late", deadline_ts=time.time() - 1)
    assert late["phase"] in ("preparing", "prepared")
    assert (await control.ok("status"))["checkpoint_id"] == "late"
    retried = await control.ok("prepare", checkpoint_id="late")
    assert retried["phase"] == "prepared", retried
    await control.ok("resume", checkpoint_id="late")


async def test_auth_and_bad_bodies(participant, http):
    control = Control(http, participant.url)
    base = control.base
    async with http.get(f"{base}/status") as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    code, body = await control.call("status", token="wrong-token")
    assert code == 401
    bad = [
        b"not json",
        b"[1]",
        orjson.dumps({"checkpoint_id": "x", "deadline_ts": time.time() + 9, "extra": 1}),
        orjson.dumps({"checkpoint_id": "x"}),
        orjson.dumps({"checkpoint_id": "bad id!", "deadline_ts": time.time() + 9}),
        orjson.dumps({"checkpoint_id": "x", "deadline_ts": "soon"}),
    ]
    headers = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    for payload in bad:
        async with http.post(f"{base}/prepare", data=payload, headers=headers) as resp:
            assert resp.status == 400, payload
            assert (await resp.json())["error"]["code"] == "invalid_request"
    good = {"rollout_id": "x", "attempt": 0}
    for episode_ids, detail in (
        ([good, {"rollout_id": "x"}], "each episode ID is {rollout_id, attempt}, nothing else"),
        ([good, ["x", 0]], "each episode ID is {rollout_id, attempt}, nothing else"),
        ([good, {"rollout_id": "x", "attempt": True}], "attempt must be a non-negative integer"),
        (
            [good, {"rollout_id": "y-a2", "attempt": 0}],
            "rollout_id 'y-a2' must not end in -a<digits>",
        ),
        ([good, {"rollout_id": "a\nb", "attempt": 0}], "a rollout_id is 1-512 of"),
        ("x", "episode_ids must be a list of 0 or more"),
    ):
        code, body = await control.call(
            "restore", checkpoint_id="r", checkpoint_dir="/tmp", episode_ids=episode_ids
        )
        assert code == 400 and body["error"]["code"] == "invalid_request", body
        assert body["error"]["detail"].startswith(detail), body
    assert (await control.ok("status"))["phase"] == "idle"  # nothing opened by bad calls


async def test_control_is_404_without_a_token(start_proxy, http):
    proxy = start_proxy(workers=1)
    async with http.get(
        f"{proxy.url}/ng-control/v1/checkpoint/status", headers={"Authorization": "Bearer anything"}
    ) as resp:
        assert resp.status == 404


def test_control_token_requires_secret(tmp_path):
    proxy = ProxyProcess(workers=1, secret=None, control_token="t")
    try:
        assert proxy.wait_exit(30) == 2
        # Named as every other line names it (issue 56: this one said GYM_PROXY_SECRET).
        assert "--control-token needs --secret-file (or --secret): restored" in proxy.log()
    finally:
        proxy.close()


@BOTH_APP_KINDS
async def test_lease_expiry_resumes(in_process, http, test_app):
    proxy = await in_process(
        "--lease-grace", "0.5", workers=1, control_token=CONTROL_TOKEN, app=test_app
    )
    control = Control(http, proxy.url)
    await control.ok("prepare", checkpoint_id="lease", deadline_ts=time.time() + 1)
    renewed = await control.ok("renew", checkpoint_id="lease", deadline_ts=time.time() + 1.5)
    assert renewed["lease_expires_at"] > time.time() + 1.5

    async def idle():
        return (await control.ok("status"))["phase"] == "idle"

    await wait_until(idle, 10, "the lease to expire")
    code, body = await control.call("commit", checkpoint_id="lease", checkpoint_dir="/tmp")
    assert code == 409 and body["error"]["code"] == "stale_checkpoint"
    async with http.post(f"{proxy.url}/seed_session", json={}) as resp:
        assert resp.status == 200  # admission is open again


async def test_a_damaged_checkpoint_is_422_and_installs_nothing(start_proxy, http, tmp_path):
    """One damage, end to end through the control plane (the checkpointer's rig,
    tests/test_checkpointer_core.py, runs every kind of damage in process)."""
    first = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    control = Control(http, first.url)
    token = await new_session(http, first.url, 3)
    reply = await control.checkpoint("good", str(tmp_path))
    await control.ok("resume", checkpoint_id="good")
    base = records.checkpoint_path(str(tmp_path), "resources", "apps")
    records_path = base / reply["manifest"]["records_file"]
    records_path.write_bytes(records_path.read_bytes().replace(b"session", b"sessiom"))
    second = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, second.url)
    code, body = await control.call(
        "restore", checkpoint_id="bad", checkpoint_dir=str(tmp_path), episode_ids=[]
    )
    assert code == 422 and body["error"]["code"] == "invalid_checkpoint_state", body
    status = await control.ok("status")
    assert status["phase"] == "idle" and status["session_aliases"] == {}
    assert status["restored_pending"] == []
    async with http.post(f"{second.url}/get_counter_value", headers={TOKEN: token}) as resp:
        assert resp.status == 410  # nothing was installed: the old owner is unknown


async def test_crash_between_records_and_manifest(start_proxy, http, tmp_path):
    good, torn = tmp_path / "good", tmp_path / "torn"
    first = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    control = Control(http, first.url)
    token = await new_session(http, first.url, 7)
    await control.checkpoint("c1", str(good))
    await control.ok("resume", checkpoint_id="c1")
    first.kill_all()

    crashing = start_proxy(
        workers=1, control_token=CONTROL_TOKEN, env={"GYM_PROXY_FAILPOINTS": "after-records"}
    )
    control = Control(http, crashing.url)
    await control.ok("prepare", checkpoint_id="c2")
    code, _ = await _call_dies(control, "commit", checkpoint_id="c2", checkpoint_dir=str(torn))
    assert crashing.wait_exit(10) == 97
    crashing.kill_all()
    base = records.checkpoint_path(str(torn), "resources", "apps")
    assert list(base.glob("records-*.jsonl")) and not (base / "manifest.json").exists()

    third = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, third.url)
    code, body = await control.call(
        "restore", checkpoint_id="r1", checkpoint_dir=str(torn), episode_ids=[]
    )
    assert code == 422
    await control.ok("restore", checkpoint_id="r2", checkpoint_dir=str(good), episode_ids=[])
    await control.ok("resume", checkpoint_id="r2")
    async with http.post(f"{third.url}/get_counter_value", headers={TOKEN: token}) as resp:
        assert (await resp.json())["count"] == 7


async def _call_dies(control, op, **body):
    try:
        return await control.call(op, **body)
    except Exception as exc:  # the proxy died mid-call, as intended
        return None, exc


@BOTH_APP_KINDS
async def test_retire_cancels_and_frees_an_attempt(participant, http):
    control = Control(http, participant.url)
    run = asyncio.ensure_future(
        http.post(
            f"{participant.url}/run", json={"_ng_rollout_id": "ret", "steps": 2, "gate": "never"}
        )
    )

    await wait_until(lambda: _in_flight(control, 1), 10, "the episode to run")
    await control.ok("prepare", checkpoint_id="open")
    code, body = await control.call(
        "retire", checkpoint_id="x", episode_ids=[{"rollout_id": "ret", "attempt": 0}]
    )
    assert code == 409 and body["error"]["code"] == "invalid_phase"
    await control.ok("resume", checkpoint_id="open")
    reply = await control.ok(
        "retire", checkpoint_id="x", episode_ids=[{"rollout_id": "ret", "attempt": 0}]
    )
    assert reply == {"retired": ["ret"]}
    resp = await asyncio.wait_for(run, 10)
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_attempt"
    status = await control.ok("status")
    assert sum(w["in_flight"] for w in status["workers"]) == 0
