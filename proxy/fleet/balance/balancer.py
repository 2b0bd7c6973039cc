"""`--rebalance`: sessions that follow load. Samples every worker's load
(`proxy.fleet.balance.load`; always, for /metrics), and with `--rebalance` asks the policy who
sheds (`proxy.fleet.balance.rebalance`) and moves the idle sessions of each worker that sheds
with the mover, as a drain moves them. With `--max-workers` it hands the same loads to
the autoscaler (`proxy.fleet.balance.autoscale`) each round too.

What it never does:
- move a session with a request running: only sessions with none running when it looks
  are picked, and the mover's own wait, bounded by `MOVE_WITHIN`, leaves any that became
  busy where they are;
- move a session that carries the worker's load, however idle between its calls: the
  worker says what each of its sessions cost it lately (`held`: `worker.session_load`),
  and the policy keeps those (`proxy.fleet.balance.rebalance.carriers`); nor one it moved less
  than `settle` ago, nor one back to a worker that shed it;
- act while a checkpoint is open, a take-over runs, or an operator's move or operation
  runs: it skips that round and says so (one log line per streak, and
  `gym_proxy_rebalance_skipped_total{why}`);
- keep a checkpoint or an operation waiting long: it holds the exclusion as one that gives
  way (`coordinator.exclusion.Exclusion.give_way`): asked to, its move stops waiting for
  the sessions not at their boundary yet (they stay), and the round ends there.

Each rebalance is one log line (who, why with the figures, how many moved to whom) and
counted in `gym_proxy_rebalances_total{reason}` and
`gym_proxy_rebalance_sessions_moved_total{reason}`. A stalled worker takes no new
sessions (`WorkerRoute.stalled`) while the policy says it is stalled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gym_proxy.coordinator.contract.answers import Rebalance, RebalanceStatus, WorkerLoadView
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.messages import HeldSessions, ListHeld
from gym_proxy.coordinator.exclusion import Exclusion
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.balance.autoscale import Autoscaler, ScaleBounds
from gym_proxy.proxy.fleet.balance.load import SAMPLE, LoadTracker, WorkerLoad
from gym_proxy.proxy.fleet.balance.rebalance import Cost, RebalancePolicy, Shed, Thresholds
from gym_proxy.proxy.fleet.moves.mover import Mover
from gym_proxy.proxy.fleet.supervision.liveness import PING_INTERVAL
from gym_proxy.proxy.fleet.supervision.slots import Slots
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerProcess

__all__ = ["Balancer", "MOVE_WITHIN", "RECENT", "thresholds_of", "bounds_of"]

log = logging.getLogger("gym_proxy.rebalance")

JUDGE_EVERY = 1.0  # seconds between the policy's judgements
LIST_WITHIN = 2.0  # seconds a worker has to list its sessions (a stalled one may not)
MOVE_WITHIN = 5.0  # seconds a rebalance's moves may take (a stalled source is slow)
RECENT = 32  # rebalances `status` lists, latest last
# A moved session stays this many cool-downs where it went: past the rest of the worker
# that took it, so that what it carried there shows before it may move on.
SETTLE_COOLDOWNS = 3.0


def thresholds_of(config: Config) -> Thresholds:
    """The policy's thresholds as the operator set them (flags or the config block)."""
    return Thresholds(
        ratio=config.rebalance_ratio,
        stall=config.stall_threshold,
        cooldown=config.rebalance_cooldown,
        max_moves=config.rebalance_max_moves,
        settle=SETTLE_COOLDOWNS * config.rebalance_cooldown,
    )


def bounds_of(config: Config) -> ScaleBounds | None:
    """The worker count's bounds and thresholds, None without --max-workers."""
    if not config.max_workers:
        return None
    return ScaleBounds(
        least=config.min_workers,
        most=config.max_workers,
        up_busy=config.scale_up_busy,
        down_busy=config.scale_down_busy,
        up_after=config.scale_up_after,
        down_after=config.scale_down_after,
    )


@dataclass
class _Look:
    """What a load sample reads of one worker (`proxy.fleet.balance.load.Sampled`)."""

    owner: str
    slot: int
    in_flight: int
    served: int
    ping_seconds: float | None
    loop_lag_seconds: float
    silent_for: float
    taking: bool


@dataclass(eq=False)
class Balancer:
    slots: Callable[[], Slots]
    mover: Mover
    exclusion: Exclusion
    thresholds: Thresholds
    acting: bool = True  # False: it only measures (no --rebalance)
    autoscaler: Autoscaler | None = None  # with --max-workers
    taking_over: Callable[[], bool] = lambda: False  # the workers go to a successor
    tracker: LoadTracker = field(default_factory=lambda: LoadTracker(PING_INTERVAL))
    policy: RebalancePolicy = field(init=False)
    # /metrics: rebalances and sessions moved by reason, rounds skipped by why.
    rebalances: dict[str, int] = field(default_factory=lambda: {"hot": 0, "stalled": 0})
    moved: dict[str, int] = field(default_factory=lambda: {"hot": 0, "stalled": 0})
    skipped: dict[str, int] = field(default_factory=dict)
    # `status`: the latest rebalances, each with the sessions it moved and where to.
    recent: deque[Rebalance] = field(default_factory=lambda: deque(maxlen=RECENT))
    _skipping: str = ""

    def __post_init__(self) -> None:
        self.policy = RebalancePolicy(self.thresholds)

    @property
    def loads(self) -> dict[str, WorkerLoad]:
        return self.tracker.loads

    def status(self) -> RebalanceStatus:
        """For the control call `status`: whether it acts, who is stalled (by slot) and the
        latest rebalances (a controller can tell every move it did not ask for)."""
        stalled = sorted(load.slot for o, load in self.loads.items() if o in self.policy.stalled)
        return RebalanceStatus(self.acting, stalled, list(self.recent))

    def load_of(self, owner: str) -> WorkerLoadView | None:
        """One worker's load as `status` shows it; None before its first sample."""
        load = self.loads.get(owner)
        if load is None:
            return None
        return WorkerLoadView(
            busy_average=round(load.busy, 3),
            answer_s=None if load.answer_seconds is None else round(load.answer_seconds, 4),
            loop_delay_s=round(load.lag_peak, 3),
            stalled=owner in self.policy.stalled,
        )

    async def watch(self) -> None:
        """Sample every SAMPLE seconds, judge every JUDGE_EVERY, while the server serves."""
        judged = time.monotonic()
        while True:
            await asyncio.sleep(SAMPLE)
            now = time.monotonic()
            workers = self._workers()
            self.tracker.sample((self._look(w, now) for w in workers), now)
            if now - judged >= JUDGE_EVERY:
                judged = now
                if self.acting and not await self.judge(workers, now):
                    continue  # it gave way: what asked is not yet where it will be seen
                if self.autoscaler is not None:
                    stalled, in_the_way = self.policy.stalled, self._in_the_way()
                    await self.autoscaler.judge(self.loads, stalled, in_the_way, now)

    async def judge(self, workers: list[WorkerProcess], now: float) -> bool:
        """One round: who sheds, then each shed carried out (or skipped, said why);
        False when a shed gave way."""
        loads = self.tracker.loads
        sheds = self.policy.judge(loads, now)
        self.policy.forget(set(loads))
        for worker in workers:
            if worker.route is not None:
                worker.route.stalled = worker.owner in self.policy.stalled
        by_owner = {w.owner: w for w in workers}
        for shed in sheds:
            why_not = self._in_the_way()
            if why_not:
                self._skip(why_not, shed)
                return True
            source = by_owner.get(shed.source)
            if source is not None and not await self._carry_out(shed, source):
                return False  # what asked for the exclusion comes first
        self._skipping = ""
        return True

    def _workers(self) -> list[WorkerProcess]:
        return [
            w
            for w in self.slots().workers()
            if w.state == "live" and w.route is not None and w.channel is not None and not w.leaving
        ]

    @staticmethod
    def _look(worker: WorkerProcess, now: float) -> _Look:
        route = worker.route
        assert route is not None
        taking = route.responsive and not route.draining
        silent = now - worker.answered_at if worker.answered_at else 0.0
        return _Look(
            owner=worker.owner,
            slot=worker.slot,
            in_flight=route.in_flight,
            served=route.served,
            ping_seconds=worker.ping_seconds,
            loop_lag_seconds=worker.loop_lag_seconds,
            silent_for=silent,
            taking=taking,
        )

    def _in_the_way(self) -> str:
        if self.taking_over():
            return "a take-over is under way"
        if self.exclusion.open_checkpoint() is not None:
            return "a checkpoint is open"
        if self.exclusion.operation is not None:
            return f"a {self.exclusion.operation} is running"
        return ""

    def _skip(self, why: str, shed: Shed) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1
        if self._skipping != why:  # one line per streak, not one a second
            self._skipping = why
            log.info("rebalance of worker %d (%s) skipped: %s", shed.slot, shed.reason, why)

    async def _carry_out(self, shed: Shed, source: WorkerProcess) -> bool:
        """Move what `shed` calls for; False when it gave way."""
        budget = self.policy.budget(time.monotonic())  # what the sheds before it left
        if budget < 1:
            return True
        held = await self._listing(source)
        if held is None or not held.movable:
            return True
        busy = {s for e in held.episodes for s in ([e.session_id] if e.session_id else [])}
        busy.update(s for e in held.episodes for s in e.sessions)
        listed = [s for s in held.session_ids if s not in busy]
        # An app's own session ID (NeMo Gym's) runs its requests under the gym-proxy
        # sessions that carried them: idle is none of them running.
        links = await self.mover.linked_sessions(listed, LIST_WITHIN) if listed else {}
        table = self.mover.table

        def running(session_id: str) -> bool:
            ids = (session_id, *links.get(session_id, ()))
            return any(table.running_requests(x) for x in ids)

        # One look: a session only between two of its calls is idle too, unless it
        # carries the load (the policy's). Those that wait behind a hot worker's load run
        # most of the time, and a second look would leave most of them there.
        idle = [s for s in listed if not running(s)]

        def cost(session_id: str) -> Cost:
            ids = (session_id, *links.get(session_id, ()))
            delay = sum(held.loop_delay.get(x, 0.0) for x in ids)
            return Cost(delay, sum(held.request_seconds.get(x, 0.0) for x in ids))

        costs = {s: cost(s) for s in held.session_ids}
        plan, kept = self.policy.plan(shed, idle, costs, budget, time.monotonic())
        if not plan:
            return True
        try:
            async with self.exclusion.acquire("rebalance", yields=True):
                result = await self.mover.move_sessions(
                    plan, [source], time.monotonic() + MOVE_WITHIN
                )
                gave_way = self.exclusion.giving_way
        except Exception as exc:  # a refusal (something began meanwhile), a lost channel
            log.warning("rebalance of worker %d (%s) not done: %s", shed.slot, shed.reason, exc)
            return True
        self.policy.spend(len(result.moved))
        self.policy.shed(shed, list(plan), time.monotonic())
        self.policy.moved(shed.source, result.moved, time.monotonic())
        self.rebalances[shed.reason] += 1
        self.moved[shed.reason] += len(result.moved)
        to = sorted({slot for slot in self._slots_of(set(result.moved.values()))})
        self.recent.append(
            Rebalance(
                at=time.time(),
                slot=shed.slot,
                owner=shed.source,
                reason=shed.reason,
                why=shed.why,
                moved=dict(result.moved),
                not_moved=dict(result.failed),
                kept=kept,
            )
        )
        log.info(
            "rebalance: worker %d (%s: %s) shed %d of its %d idle sessions to workers %s%s%s",
            shed.slot, shed.reason, shed.why, len(result.moved), len(idle),
            ", ".join(map(str, to)) or "-", _kept(kept), _not_moved(result.failed),
        )  # fmt: skip
        return not gave_way

    async def _listing(self, worker: WorkerProcess) -> HeldSessions | None:
        try:
            return await worker.live_channel.request(ListHeld(), within=LIST_WITHIN)
        except (ChannelClosed, ChannelTimeout, RemoteError) as exc:
            log.debug("worker %d did not list its sessions: %s", worker.slot, exc)
            return None

    def _slots_of(self, owners: set[str]) -> list[int]:
        return [w.slot for w in self._workers() if w.owner in owners]


def _not_moved(failed: dict[str, str]) -> str:
    if not failed:
        return ""
    return f"; {len(failed)} not moved ({'; '.join(sorted(set(failed.values())))})"


def _kept(kept: dict[str, str]) -> str:
    if not kept:
        return ""
    return f"; kept {len(kept)} that carry its load ({'; '.join(sorted(set(kept.values())))})"
