"""Unit tests of the pure checkpoint logic: phases, placement, readiness, store, files."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import orjson
import pytest

from gym_proxy.coordinator import checkpoint_files as records
from gym_proxy.coordinator.assignment import assign
from gym_proxy.coordinator.contract import records as record_format
from gym_proxy.coordinator.contract.answers import (
    NOT_OPEN,
    CommitAnswer,
    Manifest,
    PrepareAnswer,
    ReadinessReport,
    ResumeAnswer,
)
from gym_proxy.coordinator.contract.episodes import EpisodeId, parse_episode_key
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.messages import Report
from gym_proxy.coordinator.phases import PhaseMachine
from gym_proxy.coordinator.readiness import Readiness
from gym_proxy.worker.sessions import SessionStore

pytestmark = pytest.mark.fast

NOW = 1000.0
PREPARED = PrepareAnswer("prepared", NOT_OPEN)
COMMITTED = CommitAnswer("committed", Manifest(1, "resources", "i", "c1", "r.jsonl", "0", 0), [])


def code_of(machine, op, cid, deadline=NOW + 10, arguments=None):
    with pytest.raises(GymError) as err:
        machine.check(op, cid, deadline, NOW, arguments)
    return err.value.code


def test_phase_machine_walk():
    m = PhaseMachine(lease_grace=5)
    assert m.check("prepare", "c1", NOW + 10, NOW) is None
    m.open("c1", "preparing", NOW + 10)
    assert m.lease_expires_at == NOW + 15
    assert code_of(m, "prepare", "c2") == "checkpoint_conflict"
    assert code_of(m, "restore", "c1") == "invalid_phase"
    assert code_of(m, "commit", "c1") == "invalid_phase"  # commit only once prepared
    m.succeed("prepare", "prepared", PREPARED)
    assert m.check("prepare", "c1", NOW + 10, NOW) is PREPARED
    assert m.check("commit", "c1", NOW + 10, NOW, ("/d", None)) is None
    m.succeed("commit", "committed", COMMITTED, ("/d", None))
    # a cached reply comes back before the deadline is looked at ...
    assert m.check("commit", "c1", NOW - 5, NOW, ("/d", None)) is COMMITTED
    # ... unless the retry names another directory or scope
    assert code_of(m, "commit", "c1", arguments=("/e", None)) == "checkpoint_conflict"
    assert code_of(m, "retire", "c1") == "invalid_phase"  # resume first
    assert m.check("resume", "c1", NOW + 10, NOW) is None
    assert m.close() == "c1"
    assert m.check("resume", "c1", NOW, NOW) == ResumeAnswer("idle", True)
    assert code_of(m, "prepare", "c1") == "stale_checkpoint"
    assert m.check("retire", "c1", NOW + 10, NOW) is None  # a straggler policy may
    assert code_of(m, "commit", "c9") == "invalid_phase"
    # a prepare whose deadline passed still runs (and answers at once), as in Gen-2; the
    # other deadlined operations are refused
    assert m.check("prepare", "c9", NOW - 1, NOW) is None
    assert code_of(m, "retire", "c9", deadline=NOW - 1) == "deadline_exceeded"
    assert code_of(m, "prepare", "-bad") == "invalid_request"
    assert code_of(m, "prepare", "x" * 129) == "invalid_request"


def test_resume_fencing():
    m = PhaseMachine(lease_grace=5)
    # a resume of an ID never seen, while idle: remembered, so a delayed prepare is refused
    assert m.check("resume", "late", NOW, NOW) == ResumeAnswer("idle", True)
    assert code_of(m, "prepare", "late") == "stale_checkpoint"
    m.open("c2", "preparing", NOW + 10)
    # a resume of an ID already resumed answers idempotently while another is open
    assert m.check("resume", "late", NOW, NOW) == ResumeAnswer("idle", True)
    assert code_of(m, "resume", "c3") == "checkpoint_conflict"
    m.close()
    m.open("r", "restored", NOW + 10)
    assert m.check("retire", "r", NOW + 10, NOW) is None  # retire while restored
    assert m.check("forget", "r", NOW + 10, NOW) is None
    assert code_of(m, "retire", "other") == "checkpoint_conflict"


def test_lease_extends_and_expires():
    m = PhaseMachine(lease_grace=5)
    m.open("c", "preparing", NOW + 1)
    m.extend(NOW - 100)  # never backwards
    assert m.lease_expires_at == NOW + 6
    assert not m.lease_expired(NOW + 6)
    assert m.lease_expired(NOW + 6.1)
    m.succeed("prepare", "prepared", PREPARED)
    m.unprepare()
    assert m.phase == "preparing" and "prepare" not in m.replies
    m.abandon()
    assert m.phase == "idle" and "c" not in m.resumed


def session(sid, owner, episode=None):
    return {"episode_id": episode, "session_id": sid, "state": 1, "owner": owner}


def test_placement_keeps_owners_together_largest_first():
    recs = [session(f"a{i}", "A") for i in range(5)]
    recs += [session(f"b{i}", "B") for i in range(3)]
    recs += [session(f"c{i}", "C") for i in range(2)]
    owners = {"A": "A", "B": "B", "C": "C", "old": "B", "empty": "E"}
    result = assign(recs, owners, {"p1": "C"}, ["w1", "w2"])
    assert result.aliases["A"] == "w1" and result.aliases["B"] == "w2"
    assert result.aliases["C"] == "w2"  # 3 < 5 records: the lighter worker
    assert result.aliases["old"] == result.aliases["B"]  # follows its holder
    assert result.aliases["empty"] in ("w1", "w2")  # aliased even with no records
    assert {len(v) for v in result.records.values()} == {5}
    assert result.sessions == {"p1": "w2"}


def test_placement_spreads_ownerless_sessions_evenly():
    recs = [session(f"s{i}", None) for i in range(9)]
    result = assign(recs, {}, {}, ["w1", "w2", "w3"])
    assert Counter(result.sessions.values()) == {"w1": 3, "w2": 3, "w3": 3}
    assert result.aliases == {}


def test_placement_onto_one_worker_and_no_worker():
    recs = [session("a", "A"), session("b", "B")]
    result = assign(recs, {"A": "A", "B": "B"}, {}, ["only"])
    assert result.aliases == {"A": "only", "B": "only"} and len(result.records["only"]) == 2
    with pytest.raises(ValueError):
        assign(recs, {}, {}, [])


@dataclass
class W:
    slot: int
    owner: str


def test_readiness_fail_closed_and_sequencing():
    def rep(seq, ready, blockers, counts=None, restarts=()):
        return Report(seq, "c", ready, blockers, counts or {}, list(restarts))

    r = Readiness()
    live = [W(0, "a"), W(1, "b")]
    assert r.report(live, 3, "agent").blockers == ["agent-workers-unreported:3"]
    r.update("a", rep(2, True, [], {"door": 1}))
    r.update("b", rep(1, False, ["x"], restarts=["r"]))
    report = r.report(live, 2)
    assert report == ReadinessReport(False, ["x"], 1, {"door": 1}, ["r"])
    r.update("b", rep(3, True, []))
    r.update("b", rep(2, False, ["late"]))  # stale
    assert r.report(live, 2).ready is True
    r.forget("b", lost_while_open=True)
    assert r.report([W(0, "a")], 2).blockers == [
        "resources-workers-unreported:1",
        "resources-worker-lost",
    ]
    r.reset()
    r.update("a", rep(1, False, [f"s{i}" for i in range(150)]))
    report = r.report([W(0, "a")], 1)
    assert len(report.blockers) == 100 and report.blocker_count == 150


def test_session_store_scope_release_and_retire():
    store = SessionStore()
    store.put("u", 1)
    store.put("e", 2, episode="ep")
    store.touch("t")
    store.touch("u")  # keeps the value
    assert store.get("u") == 1 and store.get("t", 9) == 9
    exported = store.export("own", {"other"})
    assert {r["session_id"] for r in exported} == {"u", "t"}
    assert {r["session_id"] for r in store.export("own", None)} == {"u", "e", "t"}
    by_id = {r["session_id"]: r for r in store.export("own", None)}
    assert by_id["e"] == {
        "episode_id": {"rollout_id": "ep", "attempt": 0},
        "session_id": "e",
        "state": 2,
        "owner": "own",
    }
    store.install([session("r", "o", {"rollout_id": "ep", "attempt": 1}) | {"state": 5}])
    assert store.release({"ep-a1"}) == [] and store.get("r") == 5
    assert store.release(set()) == ["r"] and "r" not in store
    assert store.release_episodes({"ep"}) == ["e"] and "e" not in store
    store.install([session("q", None)])
    assert store.uninstall() == ["q"] and len(store) == 2


def test_episode_keys_round_trip():
    for rid, attempt in (("r", 0), ("r", 3), ("a-a1", 2), ("x-y", 0), ("x-a", 0)):
        ident = EpisodeId(rid, attempt)
        assert parse_episode_key(ident.key) == ident
    # The key format's one ambiguity: attempt 0 of a rollout ID ending in -a<digits>.
    assert parse_episode_key(EpisodeId("x-a1", 0).key) == EpisodeId("x", 1)
    assert EpisodeId("r", 0).key == "r" and EpisodeId("r", 2).key == "r-a2"
    assert EpisodeId("r", 2).next_attempt().key == "r-a3"


def test_records_round_trip_and_exclusive_manifest(tmp_path):
    base = records.checkpoint_path(str(tmp_path), "resources", "inst")
    recs = [session(f"s{i}", "o") for i in range(100)]
    manifest = records.write(
        base,
        kind="resources",
        instance="inst",
        checkpoint_id="c",
        records=recs,
        extras={"session_owners": {"o": "o"}, "assigned_sessions": {}, "assigned_app_sessions": {}},
    )
    assert manifest["record_count"] == 100
    assert records.read(base, kind="resources", instance="inst") == (manifest, recs)
    assert orjson.loads((base / "manifest.json").read_bytes()) == manifest
    with pytest.raises(records.InvalidCheckpoint, match="never replaced"):
        records.write(
            base,
            kind="resources",
            instance="inst",
            checkpoint_id="d",
            records=recs,
            extras={"session_owners": {}, "assigned_sessions": {}, "assigned_app_sessions": {}},
        )
    assert records.read(base, kind="resources", instance="inst")[0]["checkpoint_id"] == "c"
    assert not [p for p in base.iterdir() if p.name.startswith(".")]  # no temp files left
    with pytest.raises(records.InvalidCheckpoint, match="belongs to"):
        records.read(base, kind="agent", instance="inst")


def test_a_manifest_missing_a_field_is_refused_naming_it(tmp_path):
    """Every manifest has its seven fields; one of gym-proxy's (a placed table, or a map
    of session_owners) has all three extras too. NeMo Gym's own manifest has none of
    the extras, or a list of session_owners: each listed owner holds its own sessions."""
    recs = [session("s1", "o")]
    extras = {"session_owners": {"o": "o"}, "assigned_sessions": {}, "assigned_app_sessions": {}}
    written = records.write(
        records.checkpoint_path(str(tmp_path / "full"), "resources", "inst"),
        kind="resources",
        instance="inst",
        checkpoint_id="c",
        records=recs,
        extras=extras,
    )

    def read(manifest: dict) -> dict:
        base = records.checkpoint_path(str(tmp_path / "full"), "resources", "inst")
        (base / "manifest.json").write_bytes(orjson.dumps(manifest))
        return records.read(base, kind="resources", instance="inst")[0]

    for field in [*records.REQUIRED, *extras]:
        without = {k: v for k, v in written.items() if k != field}
        with pytest.raises(records.InvalidCheckpoint) as refused:
            read(without)
        assert str(refused.value) == f"manifest has no field {field}", field
    for field in ("assigned_sessions", "assigned_app_sessions"):
        gym_proxy = {k: v for k, v in written.items() if k != "session_owners"} | {field: {}}
        with pytest.raises(records.InvalidCheckpoint, match="no field session_owners"):
            read(gym_proxy)
    nemo_gym = {k: v for k, v in written.items() if k not in extras}
    assert read(nemo_gym) == written | {"session_owners": {}}
    assert read(nemo_gym | {"session_owners": ["o"]}) == written
    with pytest.raises(records.InvalidCheckpoint, match="lists a non-string"):
        read(nemo_gym | {"session_owners": [3]})


def test_records_in_nemo_gym_shapes(tmp_path):
    """An agent writes session_key/session, and reads it back; gym-proxy's pre-release
    `type: session` / `type: episode` records are read as they are, and refused."""
    bound = {"rollout_id": "r1", "attempt": 2}
    recs = [
        session("s1", "o", bound),
        session("s2", None),
        {"episode_id": bound, "task_digest": "d" * 64, "boundary": {"step": 3}},
    ]
    base = records.checkpoint_path(str(tmp_path), "agent", "inst")
    records.write(base, kind="agent", instance="inst", checkpoint_id="c", records=recs, extras={})
    [first, *_] = [orjson.loads(line) for line in next(base.glob("records-*")).read_bytes().split()]
    assert first == {"episode_id": bound, "session_key": "s1", "session": 1, "owner": "o"}
    manifest, back = records.read(base, kind="agent", instance="inst")
    assert back == recs and manifest["session_owners"] == {}
    assert [record_format.record_key(r) for r in back] == ["r1-a2", None, "r1-a2"]
    old_session = {"type": "session", "session_id": "x", "owner": "o", "episode": "r-a1"}
    old_episode = {"type": "episode", "rollout_id": "r", "attempt": 1, "state": {}}
    for old, problem in (
        (old_session | {"value": 4}, "has no state"),
        (old_episode, "is neither a session nor an episode record"),
    ):
        assert record_format.from_disk(dict(old)) == old
        assert record_format.validate_record(record_format.from_disk(dict(old))) == problem
    agent_without_state = {"episode_id": None, "session_key": "s", "owner": None}
    assert record_format.validate_record(record_format.from_disk(agent_without_state)) == (
        "has no state"
    )


def test_a_restore_reads_a_session_line_s_ends_and_the_worker_checks_the_whole(tmp_path):
    """A restore reads a session record's episode, ID and owner from its line's two ends
    (gym-proxy's lines, an agent's `session_key`/`session` among them, and NeMo Gym's
    resources lines with `json.dumps` spacing); any other line is parsed whole. The worker gets
    the lines as the file holds them, parses each, checks it holds what the coordinator
    placed it by (else `invalid_checkpoint_state` naming the line) and moves each bound
    session to its episode's next attempt."""
    bound = {"rollout_id": "r1", "attempt": 2}
    recs = [session("s1", "o", bound), session("s2", None)]
    base = records.checkpoint_path(str(tmp_path), "agent", "inst")
    records.write(base, kind="agent", instance="inst", checkpoint_id="c", records=recs, extras={})
    _, routed, lines = records.read_for_restore(base, kind="agent", instance="inst")
    assert routed == [{k: v for k, v in r.items() if k != "state"} for r in recs]  # no state
    spaced = json.dumps({"episode_id": None, "session_id": "s3", "state": [1], "owner": "o"})
    routed_spaced = record_format.routing_fields(spaced.encode())
    assert routed_spaced is not None and routed_spaced["session_id"] == "s3"
    inner_owner = b'{"episode_id":null,"session_id":"s4","state":{"owner":"x"}}'
    assert record_format.routing_fields(inner_owner) is None  # no top-level owner at its end
    sent = b"".join(line + b"\n" for line in lines)
    names = ["s1 o r1-a2", "s2 - -"]
    assert record_format.restored_sessions(sent, names, [1, 2], "f") == [
        session("s1", "o", {"rollout_id": "r1", "attempt": 3}),
        session("s2", None),
    ]
    twice = b'{"episode_id":null,"session_id":"s1","state":1,"session_id":"s9","owner":"o"}'
    broken = b'{"episode_id":null,"session_id":"s1","state":{,"owner":"o"}'
    old = b'{"type":"session","session_id":"s1","owner":"o","episode":null,"value":4}'
    assert record_format.routing_fields(old) is None  # parsed whole, and refused
    assert record_format.routing_fields(twice) == {
        "episode_id": None, "session_id": "s1", "owner": "o"
    }  # fmt: skip
    for line, why in ((twice, "holds other IDs"), (broken, "is not JSON"), (old, "has no state")):
        with pytest.raises(GymError, match=f"f line 7 {why}"):
            record_format.restored_sessions(line + b"\n", ["s1 o -"], [7], "f")
