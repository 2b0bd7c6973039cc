"""In-process tests of the checkpointer (`coordinator.checkpointer.Checkpointer`).

A rig of real objects: the real Checkpointer, real `Channel`s over socket pairs and real
checkpoint files in `tmp_path`. Only the workers are fake: each answers the typed channel
messages as `worker/channel_requests.py` does, records what it received, and can hold
(`hold`) or refuse (`refuse`) any message type. Nothing waits on time: every wait is on a
condition, woken by an event, bounded by `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
import pytest

from gym_proxy.coordinator import checkpoint_files as files
from gym_proxy.coordinator.checkpointer import Checkpointer, LiveWorker
from gym_proxy.coordinator.contract import answers, failpoints
from gym_proxy.coordinator.contract import messages as msg
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.records import encode, record_key, restored_sessions
from gym_proxy.coordinator.readiness import Readiness

pytestmark = pytest.mark.fast

NOW = 1000.0
INSTANCE = "inst"
GRACE = 5.0


def session(sid, owner, episode=None):
    bound = None if episode is None else episode.as_json()
    return {"episode_id": bound, "session_id": sid, "state": {"n": sid}, "owner": owner}


def installed(install: msg.Install) -> list[dict]:
    """The session records an Install carries, as the worker reads them."""
    return restored_sessions(
        bytes(install.blob), install.identities, install.numbers, install.source
    )


def episode(rollout_id, attempt, digest="digest-1"):
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task_digest": digest,
        "boundary": {"step": attempt + 3},
    }


@dataclass
class Clock:
    """The checkpointer's `clock`: deadlines are checked against it, while waits still
    last `deadline_ts - clock()` real seconds."""

    now: float = NOW

    def __call__(self):
        return self.now


@dataclass(eq=False)
class FakeWorker:
    """One worker's end of its channel, answering as a real worker does."""

    slot: int
    owner: str
    changed: asyncio.Event
    records: list = field(default_factory=list)
    blockers: list = field(default_factory=list)
    seq: int = 5  # the sequence number of its Close reply's report
    hold: dict = field(default_factory=dict)  # message TYPE -> asyncio.Event releasing it
    refuse: dict = field(default_factory=dict)  # message TYPE -> GymError
    got: list = field(default_factory=list)
    alive: bool = True
    on_export: Callable[[], None] | None = None
    link: Channel | None = None  # the coordinator's end
    channel: Channel | None = None  # the worker's end

    def types(self):
        return [m.TYPE for m in self.got]

    def received(self, kind):
        return [m for m in self.got if isinstance(m, kind)]

    async def handle(self, message):
        self.got.append(message)
        self.changed.set()
        if message.TYPE in self.hold:
            await self.hold[message.TYPE].wait()
        if message.TYPE in self.refuse:
            raise self.refuse[message.TYPE]
        match message:
            case msg.Close():
                report = msg.Report(
                    self.seq, message.checkpoint_id, not self.blockers, self.blockers, {}, []
                )
                return msg.CloseReply(report)
            case msg.Export():
                if self.on_export is not None:
                    self.on_export()
                scope = None if message.scope is None else set(message.scope)
                # As a real worker: sessions bound to no episode are always exported.
                out = [r for r in self.records if scope is None or record_key(r) in {None, *scope}]
                encoded = encode(out, message.kind)
                return msg.ExportReply(encoded.data, encoded.count, sorted(encoded.keys))
            case msg.Install():
                return msg.Installed(len(message.identities))
            case msg.Release() | msg.Uninstall():
                return msg.Released(0)
            case msg.Retire():
                return msg.Retired(len(message.episode_ids))
            case msg.Forget():
                return msg.Forgotten(message.rollout_ids)
            case msg.Reopen() | msg.Stop() | msg.TablesUpdate():
                return msg.Done()
        raise GymError("invalid_request", f"{message.TYPE} is not for a worker")


@dataclass
class FakeView:
    """The supervisor and the router as the checkpointer sees them (its `Workers` and
    `SessionTables`)."""

    expected: int
    workers: list
    changed: asyncio.Event
    aliases: dict = field(default_factory=dict)
    sessions: dict = field(default_factory=dict)
    app_sessions: dict = field(default_factory=dict)

    def live(self):
        return [
            LiveWorker(w.slot, w.owner, 100 + w.slot, w.link, 0) for w in self.workers if w.alive
        ]

    keeps_app_sessions = False

    def set_tables(self, aliases, sessions, app_sessions=None):
        self.aliases, self.sessions = dict(aliases), dict(sessions)
        self.app_sessions = dict(app_sessions or {})


@dataclass
class WatchedReadiness(Readiness):
    """Readiness that also wakes the test when a report lands."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def update(self, owner, report):
        super().update(owner, report)
        self.changed.set()


class JsonAnswers:
    """The checkpointer with each answer as the control plane renders it (`as_json`):
    these tests read answers as a controller does. Everything else is the checkpointer's."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def __getattr__(self, name: str):
        found = getattr(self.checkpointer, name)
        if not callable(found):
            return found

        def answered(result):
            is_answer = type(result).__module__ == answers.__name__
            return result.as_json() if is_answer else result

        if asyncio.iscoroutinefunction(found):

            async def call(*args, **kwargs):
                return answered(await found(*args, **kwargs))

            return call
        return lambda *args, **kwargs: answered(found(*args, **kwargs))


@dataclass
class Rig:
    cp: JsonAnswers
    view: FakeView
    workers: list
    clock: Clock
    changed: asyncio.Event

    async def until(self, predicate, within=5.0):
        """Wait until `predicate()` holds (re-checked whenever a worker or readiness moves)."""
        async with asyncio.timeout(within):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    async def prepared(self, cid="c1", deadline=NOW + 5):
        reply = await self.cp.prepare(cid, deadline)
        assert reply["phase"] == "prepared", reply
        return reply


@pytest.fixture
async def make_rig():
    """`await make_rig(owners)`: a checkpointer over fake workers, torn down after."""
    opened = []

    async def make(owners=("w0", "w1")):
        changed = asyncio.Event()
        workers = [FakeWorker(slot, owner, changed) for slot, owner in enumerate(owners)]
        view = FakeView(len(owners), workers, changed)
        clock = Clock()
        readiness = WatchedReadiness(changed=changed)
        cp = Checkpointer(view, view, INSTANCE, GRACE, clock=clock, readiness=readiness)
        for w in workers:
            left, right = socket.socketpair()
            reader, writer = await asyncio.open_connection(sock=left)
            w_reader, w_writer = await asyncio.open_connection(sock=right)
            w.link = Channel(reader, writer, functools.partial(cp.on_message, w.owner))
            w.channel = Channel(w_reader, w_writer, w.handle)
            opened.append((w, [asyncio.ensure_future(c.serve()) for c in (w.link, w.channel)]))
            cp.register_reply(joining(w.owner))
        return Rig(JsonAnswers(cp), view, workers, clock, changed)

    yield make
    for w, tasks in opened:
        for gate in w.hold.values():
            gate.set()
        for end in (w.link, w.channel):
            assert end is not None
            end.close()
        await asyncio.gather(*tasks)


@pytest.fixture
def stalled_write(monkeypatch):
    """The commit's file write stops after its records file, before the manifest (at the
    `after-records` failpoint), until `release` is set; `reached` says it got there."""
    reached, release = threading.Event(), threading.Event()

    def stall(name):
        reached.set()
        release.wait(10)

    monkeypatch.setattr(failpoints, "hit", stall)
    yield reached, release
    release.set()


async def reached_in_time(event):
    assert await asyncio.wait_for(asyncio.to_thread(event.wait, 5), 6)


async def refusal(call):
    """The GymError that awaiting `call` raises."""
    with pytest.raises(GymError) as err:
        await call
    return err.value


def held(worker, kind):
    gate = asyncio.Event()
    worker.hold[kind.TYPE] = gate
    return gate


def manifest_path(directory):
    return files.checkpoint_path(str(directory), "resources", INSTANCE) / files.MANIFEST


def write_checkpoint(directory, records, session_owners):
    """Checkpoint "c0" as `checkpoint_files.write` writes it."""
    files.write(
        files.checkpoint_path(str(directory), "resources", INSTANCE),
        kind="resources",
        instance=INSTANCE,
        checkpoint_id="c0",
        records=records,
        extras={
            "session_owners": session_owners,
            "assigned_sessions": {},
            "assigned_app_sessions": {},
        },
    )


async def restored_rig(make_rig, tmp_path, records, scope):
    """A rig restored from a checkpoint `files.write` wrote ("c0", owners w0/w1)."""
    write_checkpoint(tmp_path, records, {"w0": "w0", "w1": "w1"})
    rig = await make_rig(("n0", "n1"))
    reply = await rig.cp.restore("rst", NOW + 5, str(tmp_path), scope)
    return rig, reply


# ---- prepare ------------------------------------------------------------------------------
async def test_prepare_closes_every_worker_and_caches_prepared(make_rig):
    """Every live worker gets Close; all ready -> `prepared`; a retry is the cached reply
    and closes nobody again."""
    rig = await make_rig()
    reply = await rig.prepared()
    assert [w.received(msg.Close) for w in rig.workers] == [[msg.Close("c1")]] * 2
    assert reply["report"]["ready"] and rig.cp.status()["phase"] == "prepared"
    assert [w["ready"] for w in rig.cp.status()["workers"]] == [True, True]
    assert await rig.cp.prepare("c1", NOW - 1) == reply
    cached = await rig.cp.checkpointer.prepare("c1", NOW - 1)  # the very answer, again
    assert cached is await rig.cp.checkpointer.prepare("c1", NOW - 1)
    assert [len(w.received(msg.Close)) for w in rig.workers] == [1, 1]


async def test_prepare_names_blockers_until_a_later_ready_report(make_rig):
    """A blocked worker keeps the participant `preparing` (its blockers named); a stale
    lower-seq report changes nothing; a higher-seq ready report flips it to prepared."""
    rig = await make_rig()
    rig.workers[1].blockers = ["session:s1", "r7"]
    waiting = asyncio.ensure_future(rig.cp.prepare("c1", NOW + 5))
    await rig.until(lambda: len(rig.cp.readiness.reports) == 2)
    polled = await rig.cp.prepare("c1", NOW - 1)  # deadline passed: answers at once
    assert polled["phase"] == "preparing"
    assert polled["report"]["blockers"] == ["session:s1", "r7"]
    stale = msg.Ready(4, "c1", True, [], {}, [])
    assert await rig.cp.on_message("w1", stale) is None
    other = msg.Ready(9, "c-other", True, [], {}, [])  # another checkpoint's report
    await rig.cp.on_message("w1", other)
    assert (await rig.cp.prepare("c1", NOW - 1))["report"]["blocker_count"] == 2
    assert not waiting.done()
    await rig.cp.on_message("w1", msg.Ready(6, "c1", True, [], {}, []))
    reply = await asyncio.wait_for(waiting, 5)
    assert reply["phase"] == "prepared" and reply["report"]["blockers"] == []


async def test_worker_lost_while_open_unprepares(make_rig):
    """A worker lost after prepare: back to `preparing` with `<kind>-worker-lost`."""
    rig = await make_rig()
    await rig.prepared()
    rig.workers[1].alive = False
    rig.cp.on_lost("w1")
    assert rig.cp.status()["phase"] == "preparing"
    reply = await rig.cp.prepare("c1", NOW - 1)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == [
        "resources-workers-unreported:1",
        "resources-worker-lost",
    ]


# ---- commit -------------------------------------------------------------------------------
async def test_commit_writes_every_workers_records(make_rig, tmp_path):
    """The manifest and records land under checkpoint_path; the same retry is the cached
    reply (no second export); another directory is `checkpoint_conflict`."""
    rig = await make_rig()
    rig.workers[0].records = [session("a", "w0"), episode("r1", 0)]
    rig.workers[1].records = [session("b", "w1", EpisodeId("r1", 0))]
    rig.view.sessions = {"p1": "w1", "gone": "w9"}
    await rig.prepared()
    reply = await rig.cp.commit("c1", NOW + 5, str(tmp_path), None)
    assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1"]
    base = manifest_path(tmp_path).parent
    manifest, records = files.read(base, kind="resources", instance=INSTANCE)
    assert manifest == reply["manifest"] and manifest["checkpoint_id"] == "c1"
    assert manifest["session_owners"] == {"w0": "w0", "w1": "w1"}
    assert manifest["assigned_sessions"] == {"p1": "w1"}
    assert records == rig.workers[0].records + rig.workers[1].records
    assert await rig.cp.commit("c1", NOW - 1, str(tmp_path), None) == reply
    cached = await rig.cp.checkpointer.commit("c1", NOW - 1, str(tmp_path), None)
    assert cached is await rig.cp.checkpointer.commit("c1", NOW - 1, str(tmp_path), None)
    err = await refusal(rig.cp.commit("c1", NOW + 5, str(tmp_path / "other"), None))
    assert err.code == "checkpoint_conflict"
    assert [len(w.received(msg.Export)) for w in rig.workers] == [1, 1]


async def test_commit_fails_when_a_worker_does_not_answer_export(make_rig, tmp_path):
    """A worker silent past deadline_ts: `deadline_exceeded` naming its slot, no files."""
    rig = await make_rig()
    await rig.prepared()
    held(rig.workers[0], msg.Export)  # slot 0: the first result the commit looks at
    err = await refusal(rig.cp.commit("c1", rig.clock.now + 0.05, str(tmp_path), None))
    assert err.code == "deadline_exceeded"
    assert "worker 0 did not answer export" in err.detail
    assert not manifest_path(tmp_path).parent.exists()


async def test_commit_raises_a_workers_refusal_naming_its_slot(make_rig, tmp_path):
    """A worker's error reply is the commit's error, its code kept, its slot named."""
    rig = await make_rig()
    await rig.prepared()
    rig.workers[1].refuse["export"] = GymError("unexportable_state", "session s1 is a socket")
    err = await refusal(rig.cp.commit("c1", NOW + 5, str(tmp_path), None))
    assert err.code == "unexportable_state"
    assert err.detail == "export on worker 1: session s1 is a socket"
    assert not manifest_path(tmp_path).exists()


async def test_scoped_commit_exports_and_releases_the_scope(make_rig, tmp_path):
    """A scope reaches Export and Release as capture keys; `stop` sends Stop after."""
    rig = await make_rig()
    rig.workers[0].records = [episode("r1", 0), episode("r3", 0), session("u", "w0")]
    await rig.prepared()
    scope = [EpisodeId("r2", 1), EpisodeId("r1", 0)]
    reply = await rig.cp.commit("c1", NOW + 5, str(tmp_path), scope, stop=True)
    assert reply["episode_ids"] == ["r1"]
    assert [m.scope for m in rig.workers[0].received(msg.Export)] == [["r1", "r2-a1"]]
    for w in rig.workers:
        assert w.received(msg.Release) == [msg.Release(["r1", "r2-a1"])]
        assert w.types()[-2:] == ["release", "stop"]
    assert reply["manifest"]["record_count"] == 2  # r1 and the unbound session


async def test_timed_out_commit_write_is_awaited_by_its_retry(make_rig, tmp_path, stalled_write):
    """A commit whose write outlives its deadline fails `deadline_exceeded`; the write goes
    on; a retry elsewhere is `checkpoint_conflict`, the same retry gets its manifest."""
    rig = await make_rig()
    reached, release = stalled_write
    await rig.prepared()
    deadline = NOW + 5
    # The write gets 10 ms: the clock moves while the workers export.
    rig.workers[0].on_export = lambda: setattr(rig.clock, "now", deadline - 0.01)
    err = await refusal(rig.cp.commit("c1", deadline, str(tmp_path), None))
    assert err.code == "deadline_exceeded" and "a retry waits" in err.detail
    await reached_in_time(reached)
    assert not manifest_path(tmp_path).exists()
    err = await refusal(rig.cp.commit("c1", NOW + 60, str(tmp_path / "elsewhere"), None))
    assert err.code == "checkpoint_conflict"
    retry = asyncio.ensure_future(rig.cp.commit("c1", NOW + 60, str(tmp_path), None))
    release.set()
    reply = await asyncio.wait_for(retry, 5)
    assert reply["phase"] == "committed" and manifest_path(tmp_path).exists()
    assert [len(w.received(msg.Export)) for w in rig.workers] == [1, 1]


# ---- resume during a commit ---------------------------------------------------------------
async def test_resume_stops_a_commit_before_its_manifest(make_rig, tmp_path, stalled_write):
    """Resume during the file write: the commit is `stale_checkpoint`, resume returns only
    once the write stopped, and neither manifest nor records file is left."""
    rig = await make_rig()
    reached, release = stalled_write
    await rig.prepared()
    commit = asyncio.ensure_future(rig.cp.commit("c1", NOW + 5, str(tmp_path), None))
    await reached_in_time(reached)
    resume = asyncio.ensure_future(rig.cp.resume("c1", NOW + 5))
    assert (await refusal(asyncio.wait_for(commit, 5))).code == "stale_checkpoint"
    assert not resume.done()  # waits for the write to stop
    release.set()
    assert await asyncio.wait_for(resume, 5) == {"phase": "idle", "idempotent": False}
    assert not any(manifest_path(tmp_path).parent.iterdir())
    assert [w.types()[-1] for w in rig.workers] == ["reopen", "reopen"]


async def test_resume_cancels_a_commit_waiting_for_export(make_rig, tmp_path):
    """Resume while a worker sits on Export: the commit is `stale_checkpoint`, no files."""
    rig = await make_rig()
    await rig.prepared()
    gate = held(rig.workers[0], msg.Export)
    commit = asyncio.ensure_future(rig.cp.commit("c1", NOW + 5, str(tmp_path), None))
    await rig.until(lambda: rig.workers[0].received(msg.Export))
    resume = asyncio.ensure_future(rig.cp.resume("c1", NOW + 5))
    assert (await refusal(asyncio.wait_for(commit, 5))).code == "stale_checkpoint"
    gate.set()  # the worker answers Export (dropped), then Reopen
    assert (await asyncio.wait_for(resume, 5))["phase"] == "idle"
    assert not manifest_path(tmp_path).parent.exists()
    assert rig.cp.status()["phase"] == "idle"


async def test_a_commit_resumed_after_its_manifest_leaves_none(make_rig, tmp_path):
    """Resume once the write published its manifest but before the commit answered (it
    waits on a worker's Release of a scoped commit): the commit is `stale_checkpoint`,
    so its manifest is withdrawn before resume returns, records file and all."""
    rig = await make_rig()
    await rig.prepared()
    gate = held(rig.workers[0], msg.Release)
    commit = asyncio.ensure_future(rig.cp.commit("c1", NOW + 5, str(tmp_path), []))
    await rig.until(lambda: rig.workers[0].received(msg.Release))
    assert manifest_path(tmp_path).exists()  # published; the answer waits for Release
    resume = asyncio.ensure_future(rig.cp.resume("c1", NOW + 5))
    assert (await refusal(asyncio.wait_for(commit, 5))).code == "stale_checkpoint"
    gate.set()
    assert await asyncio.wait_for(resume, 5) == {"phase": "idle", "idempotent": False}
    assert not any(manifest_path(tmp_path).parent.iterdir())


async def test_a_commit_answered_keeps_its_manifest_through_the_resume(make_rig, tmp_path):
    rig = await make_rig()
    await rig.prepared()
    reply = await rig.cp.commit("c1", NOW + 5, str(tmp_path), [])
    assert reply["phase"] == "committed"
    await rig.cp.resume("c1", NOW + 5)
    assert files.read(manifest_path(tmp_path).parent, kind="resources", instance=INSTANCE)


# ---- restore ------------------------------------------------------------------------------
async def test_restore_installs_what_a_commit_wrote(make_rig, tmp_path):
    """A commit's checkpoint restores onto fresh workers: each old owner's sessions on one
    worker, bound sessions moved to attempt N+1, out-of-scope state left out."""
    old = await make_rig()
    old.workers[0].records = [session("a", "w0"), episode("r1", 0)]
    old.workers[1].records = [session("b", "w1", EpisodeId("r1", 0)), episode("r9", 0)]
    await old.prepared()
    await old.cp.commit("c1", NOW + 5, str(tmp_path), None)
    rig = await make_rig(("n0", "n1"))
    reply = await rig.cp.restore("rst", NOW + 5, str(tmp_path), [EpisodeId("r1", 0)])
    assert reply == {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r1-a1"]}
    for w in rig.workers:
        assert w.types() == ["close", "install", "tables"]
        assert w.received(msg.TablesUpdate) == [msg.TablesUpdate({"r1": 1}, {})]
    n0, n1 = (installed(w.received(msg.Install)[0]) for w in rig.workers)
    assert n0 == [session("a", "w0")]
    assert n1 == [session("b", "w1", EpisodeId("r1", 1))]
    assert rig.view.aliases == {"w0": "n0", "w1": "n1"}
    assert rig.cp.status()["phase"] == "restored"
    assert rig.cp.status()["restored_pending"] == ["r1-a1"]
    # The workers' Close replies are the report: no worker is taken for unreported.
    assert rig.cp.status()["report"]["blockers"] == []


async def test_restore_holds_the_collector_off_and_gives_it_back(make_rig, tmp_path):
    """The cyclic collector stays off from the read to the last install (a pass over a
    large restore's parsed records stalled it by about 0.2 s) and is on again after."""
    write_checkpoint(tmp_path, [session(f"s{i}", "w0") for i in range(50)], {"w0": "w0"})
    rig = await make_rig(("n0",))
    release = rig.workers[0].hold["install"] = asyncio.Event()
    assert gc.isenabled()
    restore = asyncio.ensure_future(rig.cp.restore("rst", NOW + 5, str(tmp_path), []))
    await rig.until(lambda: rig.workers[0].received(msg.Install))
    assert not gc.isenabled()  # read, selected and placed; installing now
    release.set()
    await asyncio.wait_for(restore, 5)
    assert gc.isenabled()
    assert len(installed(rig.workers[0].received(msg.Install)[0])) == 50


async def test_restore_refused_by_a_worker_rolls_back(make_rig, tmp_path):
    """One worker refusing Install: every worker gets Uninstall, TablesUpdate, Reopen; the
    participant is idle, nothing is claimable, and the same restore can run again."""
    write_checkpoint(tmp_path, [session("a", "w0"), episode("r1", 0)], {"w0": "w0"})
    rig = await make_rig(("n0", "n1"))
    rig.workers[1].refuse["install"] = GymError("invalid_request", "no room")
    scope = [EpisodeId("r1", 0)]
    err = await refusal(rig.cp.restore("rst", NOW + 5, str(tmp_path), scope))
    assert err.code == "invalid_request"
    assert err.detail == "install on worker 1: no room; nothing was installed"
    for w in rig.workers:
        assert w.types() == ["close", "install", "uninstall", "tables", "reopen"]
    status = rig.cp.status()
    assert status["phase"] == "idle" and status["checkpoint_id"] is None
    assert status["restored_pending"] == [] and rig.view.aliases == {}
    del rig.workers[1].refuse["install"]
    assert (await rig.cp.restore("rst", NOW + 5, str(tmp_path), scope))["phase"] == "restored"


async def test_resume_rolls_back_a_running_restore(make_rig, tmp_path):
    """Resume while a worker sits on Install: the restore is `stale_checkpoint`, every
    worker's install is undone, and a later restore still runs."""
    write_checkpoint(tmp_path, [session("a", "w0")], {"w0": "w0"})
    rig = await make_rig(("n0", "n1"))
    gate = held(rig.workers[1], msg.Install)
    restore = asyncio.ensure_future(rig.cp.restore("rst", NOW + 5, str(tmp_path), []))
    await rig.until(lambda: rig.workers[1].received(msg.Install))
    resume = asyncio.ensure_future(rig.cp.resume("rst", NOW + 5))
    await rig.until(lambda: rig.workers[0].received(msg.Uninstall))  # the rollback began
    gate.set()
    assert (await refusal(asyncio.wait_for(restore, 5))).code == "stale_checkpoint"
    # It stopped the restore: not idempotent, and the ID is fenced like a resumed one.
    assert await asyncio.wait_for(resume, 5) == {"phase": "idle", "idempotent": False}
    assert (await refusal(rig.cp.prepare("rst", NOW + 5))).code == "stale_checkpoint"
    for w in rig.workers:
        assert w.types() == ["close", "install", "uninstall", "tables", "reopen"]
    assert rig.view.aliases == {} and rig.cp.status()["phase"] == "idle"
    assert (await rig.cp.restore("rst2", NOW + 5, str(tmp_path), []))["phase"] == "restored"


DAMAGES = {
    "records": lambda base, m: _rewrite(base / m["records_file"], b"session", b"sessiom"),
    "manifest": lambda base, m: (base / files.MANIFEST).unlink(),
    "digest": lambda base, m: _edit_manifest(base, m, records_sha256="0" * 64),
    "count": lambda base, m: _edit_manifest(base, m, record_count=7),
    "kind": lambda base, m: _edit_manifest(base, m, kind="agent"),
    "instance": lambda base, m: _edit_manifest(base, m, instance="other"),
}


def _rewrite(path, old, new):
    path.write_bytes(path.read_bytes().replace(old, new))


def _edit_manifest(base, manifest, **fields):
    (base / files.MANIFEST).write_bytes(orjson.dumps({**manifest, **fields}))


@pytest.mark.parametrize("damage", DAMAGES)
async def test_a_damaged_checkpoint_is_refused_and_installs_nothing(make_rig, tmp_path, damage):
    """Every way a commit's files can be damaged or foreign is `invalid_checkpoint_state`
    (422) before any worker is asked to install: the participant stays idle with no alias
    and nothing pending (tests/test_checkpoint_protocol.py keeps one real-process case)."""
    old = await make_rig()
    old.workers[0].records = [session("a", "w0")]
    await old.prepared()
    reply = await old.cp.commit("c1", NOW + 5, str(tmp_path), None)
    base = files.checkpoint_path(str(tmp_path), "resources", INSTANCE)
    DAMAGES[damage](base, reply["manifest"])
    rig = await make_rig(("n0", "n1"))
    err = await refusal(rig.cp.restore("rst", NOW + 5, str(tmp_path), []))
    assert err.code == "invalid_checkpoint_state", err
    for w in rig.workers:
        assert w.received(msg.Install) == []
    status = rig.cp.status()
    assert status["phase"] == "idle" and status["restored_pending"] == []
    assert rig.view.aliases == {}


async def test_second_restore_is_invalid_phase(make_rig, tmp_path):
    """Restore needs freshly started workers: once restored (and resumed), never again."""
    rig, _ = await restored_rig(make_rig, tmp_path, [session("a", "w0")], [])
    await rig.cp.resume("rst", NOW + 5)
    assert (await refusal(rig.cp.restore("r2", NOW + 5, str(tmp_path), []))).code == "invalid_phase"
    assert [len(w.received(msg.Install)) for w in rig.workers] == [1, 1]


# ---- claims -------------------------------------------------------------------------------
async def claim(worker, rollout_id, attempt, digest="digest-1"):
    """A claim as a worker sends it: over its channel; a refusal raised as GymError."""
    return await worker.channel.request(msg.Claim(rollout_id, attempt, digest), within=5)


async def claim_code(worker, *args):
    return (await refusal(claim(worker, *args))).code


async def test_restored_episode_is_claimed_exactly_once(make_rig, tmp_path):
    """Parked while restored; after resume the boundary goes to the first claim of attempt
    N+1; a second claim or another attempt is `stale_attempt`."""
    rig, _ = await restored_rig(make_rig, tmp_path, [episode("r1", 0)], [EpisodeId("r1", 0)])
    n0, n1 = rig.workers
    assert await claim_code(n0, "r1", 1) == "checkpoint_parked"
    await rig.cp.resume("rst", NOW + 5)
    assert await claim_code(n0, "r1", 0) == "stale_attempt"
    assert await claim_code(n0, "r1", 2) == "stale_attempt"
    assert (await claim(n1, "r1", 1)).boundary == {"step": 3}
    assert await claim_code(n0, "r1", 1) == "stale_attempt"
    assert rig.cp.status()["restored_pending"] == []


async def test_claim_of_another_task_leaves_the_record(make_rig, tmp_path):
    """A different task digest is `invalid_request`; the record stays for the right one."""
    rig, _ = await restored_rig(make_rig, tmp_path, [episode("r1", 0)], [EpisodeId("r1", 0)])
    await rig.cp.resume("rst", NOW + 5)
    assert await claim_code(rig.workers[0], "r1", 1, "digest-2") == "invalid_request"
    assert rig.cp.status()["restored_pending"] == ["r1-a1"]
    assert (await claim(rig.workers[0], "r1", 1)).boundary == {"step": 3}


# ---- retire and forget --------------------------------------------------------------------
async def test_retire_and_forget_marks(make_rig, tmp_path):
    """Retire reaches every worker and drops the claims its marks cover (only those);
    forget clears marks; status counts them."""
    records = [episode("r1", 0), episode("r2", 0)]
    scope = [EpisodeId("r1", 0), EpisodeId("r2", 0)]
    rig, _ = await restored_rig(make_rig, tmp_path, records, scope)
    await rig.cp.retire("rst", NOW + 5, [EpisodeId("r1", 0)])  # r1 continues as attempt 1
    assert rig.cp.status()["restored_pending"] == ["r1-a1", "r2-a1"]
    reply = await rig.cp.retire("rst", NOW + 5, [EpisodeId("r1", 1), EpisodeId("r9", 4)])
    assert reply == {"retired": ["r1-a1", "r9-a4"]}
    status = rig.cp.status()
    assert status["restored_pending"] == ["r2-a1"] and status["retired_rollouts"] == 2
    expected = msg.Retire([msg.EpisodeRef("r1", 1), msg.EpisodeRef("r9", 4)])
    assert all(w.received(msg.Retire)[-1] == expected for w in rig.workers)
    await rig.cp.resume("rst", NOW + 5)
    assert await claim_code(rig.workers[0], "r1", 1) == "stale_attempt"
    assert await rig.cp.forget("after", NOW + 5, ["r9", "r9"]) == {"forgotten": ["r9"]}
    assert all(w.received(msg.Forget) == [msg.Forget(["r9"])] for w in rig.workers)
    assert rig.cp.marks.as_dict() == {"r1": 1} and rig.cp.status()["retired_rollouts"] == 1


# ---- the lease and the inbox --------------------------------------------------------------
async def test_expired_lease_resumes_by_itself(make_rig):
    """Renew moves the lease; past deadline + lease_grace the checkpoint resumes itself:
    every worker gets Reopen and the ID is fenced."""
    rig = await make_rig()
    await rig.prepared("c1", NOW + 1)
    assert (await rig.cp.renew("c1", NOW + 10))["lease_expires_at"] == NOW + 10 + GRACE
    rig.clock.now = NOW + 10 + GRACE
    assert await rig.cp.expire_lease() is False
    assert rig.workers[0].received(msg.Reopen) == []
    rig.clock.now += 0.5
    assert await rig.cp.expire_lease() is True
    assert rig.cp.status()["phase"] == "idle"
    assert [w.types()[-1] for w in rig.workers] == ["reopen", "reopen"]
    assert await rig.cp.resume("c1", NOW) == {"phase": "idle", "idempotent": True}
    assert (await refusal(rig.cp.prepare("c1", rig.clock.now + 5))).code == "stale_checkpoint"


async def test_lease_covers_a_running_commit(make_rig, tmp_path):
    """The lease runs to the *last* deadline_ts plus the grace (phases.py): a commit with
    a later deadline is not resumed away by the prepare's lease while it runs."""
    rig = await make_rig()
    await rig.prepared("c1", NOW + 1)  # lease: NOW + 1 + GRACE
    gate = held(rig.workers[0], msg.Export)
    commit = asyncio.ensure_future(rig.cp.commit("c1", NOW + 100, str(tmp_path), None))
    await rig.until(lambda: rig.workers[0].received(msg.Export))
    rig.clock.now = NOW + 2 + GRACE  # past the prepare's lease, long before the commit's deadline
    expiring = asyncio.ensure_future(rig.cp.expire_lease())
    gate.set()
    expired = await asyncio.wait_for(expiring, 5)
    assert (await asyncio.wait_for(commit, 5))["phase"] == "committed"
    assert expired is False


def joining(owner: str, **rejoin) -> msg.Register:
    """A worker's registration (`rejoin`: `rejoining`, `held`, `marks` of one a dead
    instance left)."""
    return msg.Register(0, owner, 1, "/w.sock", "resources", "aiohttp", None, False, **rejoin)


async def test_a_rejoining_worker_brings_the_marks_it_enforces(make_rig):
    """After a proxy crash the new coordinator learns the retire marks from the workers it
    adopts (marks only grow), so it counts them and a `forget` reaches them; a first
    registration's marks are not taken (a fresh worker holds none)."""
    rig = await make_rig()
    rig.cp.register_reply(joining("w0", marks={"r1": 2}))
    assert rig.cp.status()["retired_rollouts"] == 0
    rig.cp.register_reply(joining("w0", rejoining=True, marks={"r1": 2, "r2": 0}))
    rig.cp.register_reply(joining("w1", rejoining=True, marks={"r1": 1}))
    assert rig.cp.marks.as_dict() == {"r1": 2, "r2": 0}
    assert rig.cp.status()["retired_rollouts"] == 2


async def test_inbox_refuses_what_is_not_for_the_checkpointer(make_rig):
    """A message that is not for the checkpointer is refused (ended sessions go to the
    router, not here: tests/test_assembly.py); a late joiner hears of the open
    checkpoint."""
    rig = await make_rig()
    ended = msg.SessionsEnded(["s1", "s2"])
    assert (await refusal(rig.cp.on_message("w0", ended))).code == "invalid_request"
    await rig.prepared()
    assert (await refusal(rig.cp.on_message("w0", msg.Reopen()))).code == "invalid_request"
    assert rig.cp.register_reply(joining("w0")).checkpoint_id == "c1"
