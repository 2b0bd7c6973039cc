"""In-process tests of the participant runtime (`worker.runtime` and its parts: the
readiness reports, `worker.readiness`; the sessions' ends, `worker.session_ends`; the
state's records, `worker.state_records`; retired attempts, `worker.attempts`) and of the
worker's handling of coordinator messages (`worker.channel_requests`).

A rig drives the real `ParticipantRuntime` as the front doors do (`admit`, the app,
`answered`, `hold_answer`, `leave`), one asyncio task per request, and, where the runtime
talks to the coordinator, over a real `Channel` on a socket pair whose other end is a fake
coordinator that answers claims and collects notices. Nothing sleeps: every wait is on an
event or a condition, with a timeout.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from gym_proxy.coordinator.contract import messages as msg
from gym_proxy.coordinator.contract.channel import Channel, RemoteError
from gym_proxy.coordinator.contract.episodes import EpisodeId, task_digest
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.worker import attempts, session_ends, state_records
from gym_proxy.worker.channel_requests import handle_coordinator_message
from gym_proxy.worker.declaration import ParticipantHooks, Participation
from gym_proxy.worker.flights import InFlight, RequestFacts, own_cancellation
from gym_proxy.worker.identity import WorkerInfo
from gym_proxy.worker.request_context import RequestContext
from gym_proxy.worker.runtime import ParticipantRuntime
from gym_proxy.worker.sessions import session_record

pytestmark = pytest.mark.fast

WAIT = 5.0  # seconds any one wait may take before the test fails
INFO = WorkerInfo(slot=0, owner="owner-0", pid=1, socket_path="/nonexistent/worker.sock")
App = Callable[["Call", InFlight], Awaitable[int]]


def run_body(rollout: str, attempt: int = 0, **task: Any) -> bytes:
    """A /run or /seed_session body naming its rollout by `_ng_rollout_id`."""
    return orjson.dumps({"_ng_rollout_id": rollout, "_ng_attempt_index": attempt, **task})


class FakeCoordinator:
    """The coordinator's end of the channel: answers claims, collects every message."""

    def __init__(self) -> None:
        self.received: list[Any] = []
        self.boundary: Any = None  # what a claim is answered
        self.refusal: GymError | None = None  # or the refusal it gets
        self._arrived = asyncio.Condition()

    async def handle(self, message: msg.Message) -> msg.Message | None:
        self.received.append(message)
        async with self._arrived:
            self._arrived.notify_all()
        if isinstance(message, msg.Claim):
            if self.refusal is not None:
                raise self.refusal
            return msg.ClaimReply(self.boundary)
        return None

    def of(self, kind: type[msg.Message]) -> list[Any]:
        return [m for m in self.received if isinstance(m, kind)]

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(predicate), WAIT)


class Call:
    """One request played through the runtime as the aiohttp front door plays it; its
    task returns the status answered, or the code of a refusal."""

    def __init__(self, runtime: ParticipantRuntime, facts: RequestFacts, body: bytes, app: App):
        self.runtime = runtime
        self.entered = asyncio.Event()  # admitted: the app runs
        self.finish = asyncio.Event()  # the apps below answer once it is set
        self.status = 200
        self.own_cancellation: bool | None = None
        self.task = asyncio.create_task(self._play(facts, body, app))

    async def _play(self, facts: RequestFacts, body: bytes, app: App) -> int | str:
        async def read_body() -> bytes:
            return body

        try:
            flight = await self.runtime.admit(facts, read_body)
        except GymError as exc:
            return exc.code
        try:
            self.entered.set()
            status = await app(self, flight)
            self.runtime.answered(flight, status)
            await self.runtime.hold_answer(flight)
            return status
        except asyncio.CancelledError:
            self.own_cancellation = own_cancellation(flight)
            if self.own_cancellation:
                return "stale_attempt"
            raise
        finally:
            self.runtime.leave(flight)

    @property
    def flight(self) -> InFlight | None:
        """The runtime's record of this request (also while it waits at the door)."""
        return next((f for f in self.runtime.flights if f.task is self.task), None)

    async def admitted(self) -> None:
        await asyncio.wait_for(self.entered.wait(), WAIT)

    async def result(self) -> int | str:
        return await asyncio.wait_for(self.task, WAIT)

    async def answer(self) -> int | str:
        self.finish.set()
        return await self.result()


# ---- apps: what runs between admission and the answer ----------------------------------
async def answer_when_told(call: Call, flight: InFlight) -> int:
    await call.finish.wait()
    return call.status


async def keep_state(call: Call, flight: InFlight) -> int:
    """Keeps `{"n": 1}` in the session store, as `current_session(request).set` does."""
    RequestContext(call.runtime, flight).session.set({"n": 1})
    return await answer_when_told(call, flight)


async def park_at_boundary(call: Call, flight: InFlight) -> int:
    await call.finish.wait()
    assert flight.episode is not None
    await flight.episode.boundary({"step": 1})
    return 200


def tunnel_app(closed: asyncio.Event) -> App:
    """Becomes a tunnel whose server-side close sets `closed`."""

    async def app(call: Call, flight: InFlight) -> int:
        call.runtime.tunnel_opened(flight, closed.set)
        return await answer_when_told(call, flight)

    return app


class Rig:
    """A runtime, a fake coordinator, and the requests played against them."""

    def __init__(self, participation: Participation) -> None:
        self.runtime = runtime = ParticipantRuntime(INFO, participation)
        self.coordinator = FakeCoordinator()
        self.calls: list[Call] = []
        self.channels: list[Channel] = []  # the worker's end, the coordinator's
        self.tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        notify = runtime.readiness.changed

        def changed() -> None:  # the runtime's own "readiness changed", observed
            notify()
            self._changed.set()

        # A method replaced on purpose: each call is observed, as it is called.
        runtime.readiness.changed = changed  # type: ignore[method-assign]

    async def connect(self) -> None:
        async def serve(message: msg.Message) -> msg.Message:
            return await handle_coordinator_message(self.runtime, message)

        left, right = socket.socketpair()
        self.channels = [
            Channel(*await asyncio.open_connection(sock=left), serve),
            Channel(*await asyncio.open_connection(sock=right), self.coordinator.handle),
        ]
        self.tasks = [asyncio.create_task(c.serve()) for c in self.channels]
        self.runtime.channel = self.channels[0]

    def play(self, path, session=None, *, key=None, new=False, body=b"", app=answer_when_told):
        call = Call(self.runtime, RequestFacts("POST", path, session, new, key), body, app)
        self.calls.append(call)
        return call

    async def done(self, path: str, session: str | None = None, **kwargs: Any) -> int | str:
        """Play a request that answers at once; return its result."""
        call = self.play(path, session, **kwargs)
        return await call.answer()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate` holds, checked whenever readiness changes."""
        async with asyncio.timeout(WAIT):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    def at(self, position: str, *calls: Call) -> bool:
        return all(c.flight is not None and c.flight.position == position for c in calls)

    async def close(self) -> None:
        self.runtime.open_door()
        for call in self.calls:
            call.task.cancel()
        await asyncio.gather(*(c.task for c in self.calls), return_exceptions=True)
        for channel in self.channels:
            channel.close()
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), WAIT)


@pytest.fixture
async def rig_of():
    made: list[Rig] = []

    async def make(participation: Participation | None = None, connect: bool = False) -> Rig:
        made.append(rig := Rig(participation or Participation()))
        if connect:
            await rig.connect()
        return rig

    yield make
    for rig in made:
        await rig.close()


# ---- admission -------------------------------------------------------------------------
async def test_an_open_door_admits_at_once(rig_of):
    """With the door open a request runs at once and is tracked while it runs."""
    rig = await rig_of()
    call = rig.play("/step", "s1")
    await call.admitted()
    assert rig.at("running", call)
    assert await call.answer() == 200
    assert not rig.runtime.flights and "s1" in rig.runtime.store


async def test_a_closed_gate_holds_every_request_at_the_door(rig_of):
    """New sessions, a new episode /run and calls on existing sessions all wait at the
    door while closed, are counted there, do not block readiness, and enter at open."""
    rig = await rig_of()
    runtime = rig.runtime
    runtime.close_door("ck")
    calls = [
        rig.play("/seed_session", "fresh", new=True, body=b"{}"),
        rig.play("/run", body=orjson.dumps({"_ng_task_index": 3, "_ng_rollout_index": 1})),
        rig.play("/step", "s1"),
    ]
    await rig.until(lambda: rig.at("door", *calls))
    assert not any(c.entered.is_set() for c in calls)
    report = runtime.readiness.report()
    assert (report.ready, report.blockers, report.checkpoint_id) == (True, [], "ck")
    assert report.counts["door"] == report.counts["in_flight"] == 3
    assert calls[1].flight.identity == EpisodeId("3-1", 0)
    runtime.open_door()
    for call in calls:
        await call.admitted()
    assert [await c.answer() for c in calls] == [200, 200, 200]


async def test_a_model_serves_other_routes_and_parks_generation_while_closed(rig_of):
    """A model runtime keeps non-generation routes serving while closed, waits
    generation calls at the door, and holds an admitted generation's answer."""
    rig = await rig_of(Participation(kind="model"))
    runtime = rig.runtime
    held = rig.play("/v1/chat/completions")
    await held.admitted()
    runtime.close_door("ck")
    models = rig.play("/v1/models")
    await models.admitted()
    assert await models.answer() == 200
    door = rig.play("/v1/chat/completions")
    held.finish.set()
    await rig.until(lambda: rig.at("door", door) and rig.at("parked", held))
    assert not held.task.done() and not door.entered.is_set()
    assert runtime.readiness.report().ready
    runtime.open_door()
    assert await held.result() == 200
    await door.admitted()
    assert await door.answer() == 200


# ---- readiness -------------------------------------------------------------------------
async def test_running_requests_block_until_parked(rig_of):
    """A running request blocks, named by its episode key, its session or its path;
    the worker is ready once the episode parks at a boundary and the others end."""
    rig = await rig_of()
    runtime = rig.runtime
    episode = rig.play("/step", key="r7-a2", app=park_at_boundary)
    session = rig.play("/step", "s1")
    bare = rig.play("/health")
    for call in (episode, session, bare):
        await call.admitted()
    runtime.close_door("ck")
    report = runtime.readiness.report()
    assert not report.ready
    assert report.blockers == ["r7-a2", "request:/health", "session:s1"]
    episode.finish.set()
    await rig.until(lambda: rig.at("parked", episode))
    assert runtime.readiness.report().blockers == ["request:/health", "session:s1"]
    assert [await session.answer(), await bare.answer()] == [200, 200]
    assert runtime.readiness.report().ready and runtime.readiness.report().counts["parked"] == 1
    runtime.open_door()
    assert await episode.result() == 200


async def test_restart_only_never_blocks_and_lists_its_restarts(rig_of):
    """A restart-only participant is ready with requests running, and lists as restarts
    the episodes of its live bound sessions and of its requests in flight."""
    rig = await rig_of(Participation(kind="agent", restart_only=True))
    assert await rig.done("/seed_session", "s1", body=run_body("rA", 1)) == 200
    assert await rig.done("/step", "loose") == 200
    running = rig.play("/run", body=run_body("rB"))
    other = rig.play("/step", "s2")
    await running.admitted()
    await other.admitted()
    rig.runtime.close_door("ck")
    report = rig.runtime.readiness.report()
    assert (report.ready, report.blockers, report.restarts) == (True, [], ["rA-a1", "rB"])
    assert report.counts["unbound_sessions"] == 1


async def test_restart_only_resources_blocks_on_unbound_sessions(rig_of):
    """A restart-only resources server's live session bound to no episode would be
    lost: it blocks (`resources-unbound-sessions:<n>`) until it ends."""
    rig = await rig_of(Participation(restart_only=True))
    assert await rig.done("/step", "s1") == 200
    rig.runtime.close_door("ck")
    assert rig.runtime.readiness.report().blockers == ["resources-unbound-sessions:1"]
    rig.runtime.open_door()
    assert await rig.done("/close_session", "s1") == 200
    rig.runtime.close_door("ck")
    assert rig.runtime.readiness.report().ready


async def test_ready_notices_follow_changes_with_increasing_seq(rig_of):
    """While closed, every change reaches the coordinator as a Ready notice, sequenced."""
    rig = await rig_of(connect=True)
    coordinator = rig.coordinator
    busy = rig.play("/step", "s9")
    await busy.admitted()
    rig.runtime.close_door("ck")
    await coordinator.until(lambda: coordinator.of(msg.Ready) != [])
    assert coordinator.of(msg.Ready)[0].blockers == ["session:s9"]
    assert await busy.answer() == 200
    await coordinator.until(lambda: coordinator.of(msg.Ready)[-1].ready)
    door = rig.play("/step", "s1")
    await coordinator.until(lambda: coordinator.of(msg.Ready)[-1].counts["door"] == 1)
    readies = coordinator.of(msg.Ready)
    seqs = [r.seq for r in readies]
    assert seqs == sorted(set(seqs)) and seqs[0] >= 1
    assert {r.checkpoint_id for r in readies} == {"ck"} and readies[-1].ready
    rig.runtime.open_door()
    await door.admitted()


class Script:
    """An app run one step at a time: each action the test queues runs inside the
    request (`action(call, flight)`); None answers."""

    def __init__(self) -> None:
        self.actions: asyncio.Queue[Callable[[Call, InFlight], Awaitable[Any]] | None] = (
            asyncio.Queue()
        )

    async def app(self, call: Call, flight: InFlight) -> int:
        while (action := await self.actions.get()) is not None:
            await action(call, flight)
        return 200

    def do(self, action: Callable[[Call, InFlight], Awaitable[Any]] | None) -> None:
        self.actions.put_nowait(action)


def without_seq(report: msg.Report) -> dict[str, Any]:
    return {k: v for k, v in report.fields().items() if k != "seq"}


async def reported(rig: Rig, what: str, shows: Callable[[msg.Report], bool]) -> None:
    """Wait until the coordinator's latest report is the runtime's readiness now and
    `shows` the change. Nothing re-sends reports, so only a report sent because of the
    change gets there; a change that sent none fails here, named."""
    coordinator = rig.coordinator

    def arrived() -> bool:
        readies = coordinator.of(msg.Ready)
        return (
            bool(readies)
            and shows(readies[-1])
            and (without_seq(readies[-1]) == without_seq(rig.runtime.readiness.report()))
        )

    try:
        await coordinator.until(arrived)
    except TimeoutError:
        pytest.fail(f"no report followed: {what} (now {rig.runtime.readiness.report()})")


async def test_every_change_a_report_shows_is_reported(rig_of):
    """While closed, each change the readiness report shows reaches the coordinator as
    a report of its own, whatever made it: a request at the door, one gone from it, a
    session begun or ended by the app mid-request, a replay step begun and ended (the
    episode parks), a tunnel opened and closed, a request answered, and sessions the
    coordinator retires, installs and releases."""
    rig = await rig_of(Participation(tunnels="block"), connect=True)
    runtime = rig.runtime
    assert await rig.done("/seed_session", "bound", body=run_body("r2")) == 200
    episode, tunnel = Script(), Script()
    a = rig.play("/step", "a", key="r1", app=episode.app)
    t = rig.play("/ws", "t", app=tunnel.app)
    run = rig.play("/run", body=run_body("r4"))
    for call in (a, t, run):
        await call.admitted()
    runtime.close_door("ck")
    await reported(rig, "the door closed", lambda r: r.blockers == ["r1", "r4", "session:t"])

    door = rig.play("/step", "d")
    await reported(rig, "a request at the door", lambda r: r.counts["door"] == 1)
    door.task.cancel()
    await reported(rig, "a request gone from the door", lambda r: r.counts["door"] == 0)

    async def begin(call: Call, flight: InFlight) -> None:
        RequestContext(call.runtime, flight).session.set({"n": 1})

    async def end(call: Call, flight: InFlight) -> None:
        RequestContext(call.runtime, flight).session.delete()

    episode.do(begin)
    await reported(rig, "a session begun mid-request", lambda r: r.counts["sessions"] == 2)
    episode.do(end)
    await reported(rig, "a session ended mid-request", lambda r: r.counts["sessions"] == 1)

    step: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def replay(call: Call, flight: InFlight) -> None:
        assert flight.episode is not None  # a /run: it has its episode
        await flight.episode.replay(step)

    episode.do(replay)
    await reported(rig, "a replay step begun", lambda r: r.counts["replay"] == 1)
    step.set_result("done")
    await reported(rig, "a replay step ended, parked", lambda r: r.counts["parked"] == 1)

    async def upgrade(call: Call, flight: InFlight) -> None:
        call.runtime.tunnel_opened(flight, lambda: None)

    tunnel.do(upgrade)
    await reported(rig, "a tunnel opened", lambda r: "tunnel:t" in r.blockers)
    tunnel.do(None)
    await reported(rig, "a tunnel closed", lambda r: r.counts["tunnel"] == 0)
    assert await t.result() == 200
    assert await run.answer() == 200
    await reported(rig, "an episode's /run answered", lambda r: r.ready)

    await handle_coordinator_message(runtime, msg.Retire([msg.EpisodeRef("r2", 0)]))
    await reported(rig, "a retired session", lambda r: r.counts["sessions"] == 1)
    restored = session_record("back", "r3-a1", {"n": 2}, INFO.owner)
    assert await state_records.install(runtime, [restored]) == 1
    await reported(rig, "a session installed", lambda r: r.counts["sessions"] == 2)
    await handle_coordinator_message(runtime, msg.Release(keep=[]))
    await reported(rig, "a restored session released", lambda r: r.counts["sessions"] == 1)
    seqs = [r.seq for r in rig.coordinator.of(msg.Ready)]
    assert seqs == sorted(set(seqs))


async def test_a_model_route_admitted_while_closed_is_reported(rig_of):
    """A model's other routes run while closed: one admitted then is in flight at once,
    and the coordinator hears so (it never blocks a model)."""
    rig = await rig_of(Participation(kind="model"), connect=True)
    rig.runtime.close_door("ck")
    await reported(rig, "the door closed", lambda r: r.ready)
    models = rig.play("/v1/models")
    await models.admitted()
    await reported(rig, "a route admitted", lambda r: r.counts["running"] == 1 and r.ready)
    assert await models.answer() == 200
    await reported(rig, "a route answered", lambda r: r.counts["in_flight"] == 0)


# ---- tunnels ---------------------------------------------------------------------------
@pytest.mark.parametrize("policy, closes", [("close", True), ("block", False)])
async def test_a_checkpoint_closes_or_names_an_open_tunnel(rig_of, policy, closes):
    """Closing the door closes an open tunnel under `tunnels="close"`, leaves it open
    under "block"; either way it is a `tunnel:` blocker until it is gone."""
    rig = await rig_of(Participation(tunnels=policy))
    closed = asyncio.Event()
    tunnel = rig.play("/ws", "s1", app=tunnel_app(closed))
    await rig.until(lambda: rig.at("tunnel", tunnel))
    assert not closed.is_set()
    rig.runtime.close_door("ck")
    assert closed.is_set() is closes
    assert rig.runtime.readiness.report().blockers == ["tunnel:s1"]
    assert await tunnel.answer() == 200
    assert rig.runtime.readiness.report().ready


# ---- retire and forget ----------------------------------------------------------------
async def test_retire_cancels_refuses_and_frees_until_forgotten(rig_of):
    """A retire cancels the requests of the attempt and earlier ones (their front door
    answers stale_attempt), frees their sessions, refuses them and their sessions (but
    a session's close) until the rollout is forgotten."""
    retired: list[list[str]] = []

    async def on_retire(session_ids: list[str]) -> None:
        retired.append(session_ids)

    rig = await rig_of(Participation(hooks=ParticipantHooks(retire=on_retire)))
    runtime = rig.runtime
    assert await rig.done("/seed_session", "s1", body=run_body("r1", 1)) == 200
    current = rig.play("/run", body=run_body("r1", 1))
    earlier = rig.play("/step", key="r1")
    other = rig.play("/run", body=run_body("r2", 1))
    for call in (current, earlier, other):
        await call.admitted()
    reply = await handle_coordinator_message(runtime, msg.Retire([msg.EpisodeRef("r1", 1)]))
    assert isinstance(reply, msg.Retired) and reply.retired == 3  # two requests, one session
    assert [await current.result(), await earlier.result()] == ["stale_attempt"] * 2
    assert current.own_cancellation and earlier.own_cancellation
    assert not other.task.done() and retired == [["s1"]] and "s1" not in runtime.store
    assert await rig.done("/run", body=run_body("r1", 0)) == "stale_attempt"
    assert await rig.done("/step", "s1") == "stale_attempt"
    assert await rig.done("/close_session", "s1") == 200
    assert await rig.done("/run", body=run_body("r1", 2)) == 200
    forgot = await handle_coordinator_message(runtime, msg.Forget(["r1"]))
    assert isinstance(forgot, msg.Forgotten) and forgot.forgotten == ["r1"]
    assert await rig.done("/run", body=run_body("r1", 1)) == 200
    assert await rig.done("/step", "s1") == 200
    assert await other.answer() == 200


@pytest.mark.parametrize("how", ["retire", "client_gone"])
async def test_a_request_cancelled_at_the_door_leaves(rig_of, how):
    """A request cancelled while it waits at the door (a retire, a client that went
    away) is no longer in flight, and does not block readiness."""
    rig = await rig_of()
    rig.runtime.close_door("ck")
    call = rig.play("/run", body=run_body("r1"))
    await rig.until(lambda: rig.at("door", call))
    if how == "retire":
        await asyncio.wait_for(attempts.retire(rig.runtime, [EpisodeId("r1", 0)]), WAIT)
    else:
        call.task.cancel()
    await asyncio.wait_for(asyncio.wait([call.task]), WAIT)
    assert not rig.runtime.flights
    assert rig.runtime.readiness.report().ready
    if how == "retire":  # refused as a retired attempt, not dropped unanswered
        assert call.task.result() == "stale_attempt"
    else:
        assert call.task.cancelled()


# ---- claims of restored episodes ------------------------------------------------------
async def pending_r1(rig: Rig) -> None:
    tables = msg.TablesUpdate(pending={"r1": 1}, marks={})
    assert isinstance(await handle_coordinator_message(rig.runtime, tables), msg.Done)


async def test_a_restored_run_claims_its_boundary_through_the_channel(rig_of):
    """The continuing attempt's /run claims the record once and starts from its boundary."""
    rig = await rig_of(connect=True)
    await pending_r1(rig)
    rig.coordinator.boundary = {"step": 3}
    call = rig.play("/run", body=run_body("r1", 1, task="t"))
    await call.admitted()
    episode = call.flight.episode
    assert (episode.restored, episode.restored_state) == (True, {"step": 3})
    assert rig.coordinator.of(msg.Claim) == [msg.Claim("r1", 1, task_digest({"task": "t"}))]
    assert "r1" not in rig.runtime.claims
    assert await call.answer() == 200


async def test_a_wrong_attempt_is_stale_without_asking(rig_of):
    """Another attempt of a pending rollout is refused by the worker itself."""
    rig = await rig_of(connect=True)
    await pending_r1(rig)
    assert await rig.done("/run", body=run_body("r1", 2)) == "stale_attempt"
    assert "r1" in rig.runtime.claims and not rig.runtime.flights
    assert await rig.done("/run", body=run_body("r1", 1)) == 200
    assert [c.attempt for c in rig.coordinator.of(msg.Claim)] == [1]  # the channel keeps order


@pytest.mark.parametrize("code, dropped", [("stale_attempt", True), ("invalid_phase", False)])
async def test_a_refused_claim_drops_the_pending_record_only_if_stale(rig_of, code, dropped):
    """A coordinator answering stale_attempt no longer holds the record: the worker
    drops its pending claim; another refusal keeps it."""
    rig = await rig_of(connect=True)
    await pending_r1(rig)
    rig.coordinator.refusal = GymError(code, "refused by the fake coordinator")
    assert await rig.done("/run", body=run_body("r1", 1)) == code
    assert ("r1" not in rig.runtime.claims) is dropped and not rig.runtime.flights


async def test_a_claim_on_a_closed_channel_is_unavailable(rig_of):
    """With the coordinator gone a claim is checkpoint_coordinator_unavailable, and the
    pending record stays for a retry."""
    rig = await rig_of(connect=True)
    await pending_r1(rig)
    rig.channels[1].close()
    await asyncio.wait_for(rig.tasks[0], WAIT)  # the worker's end saw the close
    assert await rig.done("/run", body=run_body("r1", 1)) == "checkpoint_coordinator_unavailable"
    assert "r1" in rig.runtime.claims and not rig.runtime.flights


# ---- session ends ----------------------------------------------------------------------
async def test_closed_sessions_are_released_at_once_and_announced_in_one_batch(rig_of, monkeypatch):
    """A 2xx /close_session ends a tracked session: the app's release hook hears at
    once, and the coordinator gets one SessionsEnded for what ended meanwhile."""
    monkeypatch.setattr(session_ends, "ENDED_FLUSH", 0.02)
    released: list[list[str]] = []
    rig = await rig_of(Participation(hooks=ParticipantHooks(release=released.append)), True)
    store = rig.runtime.store
    for sid in ("s1", "s2", "s3"):
        assert await rig.done("/step", sid) == 200
    failed = rig.play("/close_session", "s3")
    failed.status = 500
    closes = [rig.play("/close_session", sid) for sid in ("s1", "s2")]
    for call in (*closes, failed):
        await call.admitted()
    for call in (*closes, failed):
        call.finish.set()  # all answer in one loop iteration, long before the flush
    assert [await c.result() for c in (*closes, failed)] == [200, 200, 500]
    assert released == [["s1"], ["s2"]] and "s1" not in store and "s3" in store
    await rig.coordinator.until(lambda: rig.coordinator.of(msg.SessionsEnded) != [])
    assert rig.coordinator.of(msg.SessionsEnded) == [msg.SessionsEnded(["s1", "s2"])]


# ---- export and install ----------------------------------------------------------------
async def test_the_session_store_exports_sessions_and_parked_episodes(rig_of):
    """The store's sessions and a parked /run's boundary are exported within the scope,
    and the session records install into another worker's store."""
    rig = await rig_of()
    runtime = rig.runtime
    seed = run_body("r1")
    assert await rig.done("/seed_session", "s1", body=seed, app=keep_state) == 200
    assert await rig.done("/step", "s2", app=keep_state) == 200
    parked = rig.play("/run", body=run_body("r5", task="t"), app=park_at_boundary)
    await parked.admitted()
    runtime.close_door("ck")
    parked.finish.set()
    await rig.until(lambda: rig.at("parked", parked))
    records = await state_records.export(runtime, None)
    assert records[-1] == {
        "episode_id": {"rollout_id": "r5", "attempt": 0},
        "task_digest": task_digest({"task": "t"}),
        "boundary": {"step": 1},
    }
    sessions = {r["session_id"]: r for r in records[:-1]}
    assert sessions["s1"]["episode_id"] == {"rollout_id": "r1", "attempt": 0}
    assert {r["owner"] for r in sessions.values()} == {INFO.owner}
    assert [r["session_id"] for r in await state_records.export(runtime, {"zz"})] == ["s2"]
    other = await rig_of()
    assert await state_records.install(other.runtime, list(sessions.values())) == 2
    assert other.runtime.store.get("s1") == {"n": 1}


async def test_hooks_export_and_restore_the_apps_own_state(rig_of):
    """With hooks the app's export is asked for the live sessions in scope (what it
    returns for others is dropped), and restore gets every restored state."""
    asked: list[list[str]] = []
    restored: list[dict[str, Any]] = []

    async def export(session_ids: list[str]) -> dict[str, Any]:
        asked.append(session_ids)
        return {**{sid: f"state-{sid}" for sid in session_ids}, "ghost": 1}

    async def restore(states: dict[str, Any]) -> None:
        restored.append(states)

    hooks = ParticipantHooks(export=export, restore=restore)
    rig = await rig_of(Participation(hooks=hooks))
    assert await rig.done("/seed_session", "s1", body=run_body("r1")) == 200
    assert await rig.done("/step", "s0") == 200
    records = await state_records.export(rig.runtime, {"r1"})
    assert asked == [["s0", "s1"]]
    assert {r["session_id"]: r["state"] for r in records} == {"s0": "state-s0", "s1": "state-s1"}
    assert [r["session_id"] for r in await state_records.export(rig.runtime, {"zz"})] == ["s0"]
    other = await rig_of(Participation(hooks=hooks))
    assert await state_records.install(other.runtime, records) == 2
    assert restored == [{"s0": "state-s0", "s1": "state-s1"}]
    assert "s1" in other.runtime.store and other.runtime.store.get("s1") is None


async def test_a_declared_session_dict_is_exported_installed_and_released(rig_of):
    """A session dict stands for hooks: tracked sessions' entries are exported, install
    writes them into the other worker's dict, and a close drops the entry."""
    states: dict[str, Any] = {"stray": 0}

    async def count(call: Call, flight: InFlight) -> int:
        assert flight.session_id is not None
        states[flight.session_id] = 7
        return 200

    rig = await rig_of(Participation(session_state=states))
    assert await rig.done("/step", "s1", app=count) == 200
    records = await state_records.export(rig.runtime, None)
    assert [(r["session_id"], r["state"]) for r in records] == [("s1", 7)]
    restored: dict[str, Any] = {}
    other = await rig_of(Participation(session_state=restored))
    assert await state_records.install(other.runtime, records) == 1
    assert restored == {"s1": 7} and "s1" in other.runtime.store
    assert await other.done("/close_session", "s1") == 200
    assert restored == {}


async def test_export_over_the_channel_checks_checkpoint_and_readiness(rig_of):
    """The coordinator's Export is refused for another checkpoint (stale_checkpoint)
    and while a request runs (invalid_phase); once ready its blob holds the records."""
    rig = await rig_of(connect=True)
    coordinator_end = rig.channels[1]
    busy = rig.play("/step", "s1", app=keep_state)
    await busy.admitted()
    closed = await coordinator_end.request(msg.Close("ck"), within=WAIT)
    assert (closed.report.ready, closed.report.blockers) == (False, ["session:s1"])
    with pytest.raises(RemoteError) as refused:
        await coordinator_end.request(msg.Export("other", None, "resources"), within=WAIT)
    assert refused.value.code == "stale_checkpoint"
    with pytest.raises(RemoteError) as refused:
        await coordinator_end.request(msg.Export("ck", None, "resources"), within=WAIT)
    assert refused.value.code == "invalid_phase" and "session:s1" in refused.value.detail
    assert await busy.answer() == 200
    reply = await coordinator_end.request(msg.Export("ck", None, "resources"), within=WAIT)
    lines = [orjson.loads(line) for line in bytes(reply.blob).splitlines()]
    record = {"episode_id": None, "session_id": "s1", "state": {"n": 1}, "owner": INFO.owner}
    assert lines == [record]
    assert (reply.count, reply.keys) == (1, [])
    assert isinstance(await coordinator_end.request(msg.Reopen(), within=WAIT), msg.Done)
    assert rig.runtime.is_open


async def test_restart_only_exports_nothing(rig_of):
    """A restart-only participant exports no records, not even of a /run in flight."""
    rig = await rig_of(Participation(kind="agent", restart_only=True))
    running = rig.play("/run", body=run_body("r1"))
    await running.admitted()
    rig.runtime.close_door("ck")
    assert rig.runtime.readiness.report().restarts == ["r1"]
    assert await state_records.export(rig.runtime, None) == []
