"""Restored episodes: exactly-one claims, commit scope, release of what a scope leaves out."""

from __future__ import annotations

import asyncio

from gym_proxy.coordinator import checkpoint_files as records
from gym_proxy.coordinator.contract.episodes import task_digest
from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN, Control

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"
RACES = 1000


def write_episode_checkpoint(directory, count):
    """A checkpoint holding `count` parked episodes (attempt 0) in NeMo Gym's record shape,
    their task the one the replacements send (`{"steps": 2}`)."""
    base = records.checkpoint_path(str(directory), "resources", "apps")
    episodes = [
        {
            "episode_id": {"rollout_id": f"race-{i}", "attempt": 0},
            "task_digest": task_digest({"steps": 2}),
            "boundary": {"step": 1, "log": [f"race-{i}:0"]},
        }
        for i in range(count)
    ]
    records.write(
        base,
        kind="resources",
        instance="apps",
        checkpoint_id="crafted",
        records=episodes,
        extras={"session_owners": {}, "assigned_sessions": {}, "assigned_app_sessions": {}},
    )


@BOTH_APP_KINDS
async def test_two_workers_race_to_claim_each_restored_episode(
    in_process, http, tmp_path, test_app
):
    write_episode_checkpoint(tmp_path, RACES)
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=test_app)
    control = Control(http, proxy.url)
    ids = [{"rollout_id": f"race-{i}", "attempt": 0} for i in range(RACES)]
    reply = await control.ok(
        "restore", checkpoint_id="race", checkpoint_dir=str(tmp_path), episode_ids=ids
    )
    assert len(reply["restored"]) == RACES and "race-7-a1" in reply["restored"]
    await control.ok("resume", checkpoint_id="race")
    owners = [w["owner"] for w in (await control.ok("status"))["workers"]]
    limit = asyncio.Semaphore(32)

    async def replacement(i, owner):
        body = {"_ng_rollout_id": f"race-{i}", "_ng_attempt_index": 1, "steps": 2}
        async with limit, http.post(f"{proxy.url}/run", json=body, headers={OWNER: owner}) as resp:
            return resp.status, await resp.json()

    async def race(i):
        results = await asyncio.gather(*(replacement(i, owner) for owner in owners))
        winners = [body for status, body in results if status == 200]
        losers = [body for status, body in results if status != 200]
        assert len(winners) == 1, (i, results)
        assert winners[0]["restored"] and winners[0]["state"]["log"] == [
            f"race-{i}:0",
            f"race-{i}-a1:1",
        ]
        assert losers[0]["error"]["code"] == "stale_attempt", losers

    await asyncio.gather(*(race(i) for i in range(RACES)))
    assert (await control.ok("status"))["restored_pending"] == []


@BOTH_APP_KINDS
async def test_commit_scope_and_release(start_proxy, http, tmp_path):
    first = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, first.url)
    tokens = {}
    for key, count in (("keep", 1), ("drop", 2), (None, 3)):
        path = f"/ng-rollout/{key}/seed_session" if key else "/seed_session"
        async with http.post(f"{first.url}{path}", json={"initial_count": count}) as resp:
            assert resp.status == 200
            tokens[key] = resp.headers[TOKEN]
    scope = [{"rollout_id": "keep", "attempt": 0}]
    reply = await control.checkpoint("scoped", str(tmp_path / "one"), episode_ids=scope)
    assert reply["manifest"]["record_count"] == 2  # the unbound session and "keep"'s
    first.kill_all()

    second = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, second.url)
    await control.ok(
        "restore", checkpoint_id="r", checkpoint_dir=str(tmp_path / "one"), episode_ids=scope
    )
    await control.ok("resume", checkpoint_id="r")
    counts = {}
    for key, token in tokens.items():
        async with http.post(f"{second.url}/get_counter_value", headers={TOKEN: token}) as resp:
            counts[key] = resp.status, (await resp.json()).get("count")
    assert counts["keep"] == (200, 1) and counts[None] == (200, 3)
    assert counts["drop"] == (200, 0)  # out of scope: not exported, so a fresh counter
    # The restored "keep" session now belongs to attempt keep-a1. A commit whose scope
    # leaves that attempt out exports nothing of it and releases it on every worker.
    reply = await control.checkpoint("narrow", str(tmp_path / "two"), episode_ids=[])
    # the unbound session, and "drop"'s, live again (unbound) since it was used above
    assert reply["manifest"]["record_count"] == 2
    await control.ok("resume", checkpoint_id="narrow")
    async with http.post(f"{second.url}/get_counter_value", headers={TOKEN: tokens["keep"]}) as r:
        assert (await r.json())["count"] == 0  # released: a fresh counter


@BOTH_APP_KINDS
async def test_unclaimed_records_are_exported_again_while_in_scope(start_proxy, http, tmp_path):
    write_episode_checkpoint(tmp_path / "one", 2)
    proxy = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    control = Control(http, proxy.url)
    both = [{"rollout_id": f"race-{i}", "attempt": 0} for i in range(2)]
    await control.ok(
        "restore", checkpoint_id="r", checkpoint_dir=str(tmp_path / "one"), episode_ids=both
    )
    await control.ok("resume", checkpoint_id="r")
    keep = [{"rollout_id": "race-0", "attempt": 1}]
    reply = await control.checkpoint("again", str(tmp_path / "two"), episode_ids=keep)
    assert reply["episode_ids"] == ["race-0-a1"] and reply["manifest"]["record_count"] == 1
    await control.ok("resume", checkpoint_id="again")
    assert (await control.ok("status"))["restored_pending"] == ["race-0-a1"]  # race-1 was released
    proxy.kill_all()

    later = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, later.url)
    reply = await control.ok(
        "restore", checkpoint_id="r2", checkpoint_dir=str(tmp_path / "two"), episode_ids=keep
    )
    assert reply["restored"] == ["race-0-a2"]
    await control.ok("resume", checkpoint_id="r2")
    body = {"_ng_rollout_id": "race-0", "_ng_attempt_index": 2, "steps": 2}
    async with http.post(f"{later.url}/run", json=body) as resp:
        assert (await resp.json())["state"]["log"] == ["race-0:0", "race-0-a2:1"]
