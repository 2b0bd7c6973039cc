"""`/metrics`: Prometheus text format on its own address (`--metrics HOST:PORT`).

The proxy is one process that sees every request and owns every worker, so it owns the
one registry (prometheus_client's multiprocess mode, with its files of dead workers, is
not needed): the data path only increments plain integers it keeps anyway, and a scrape
reads them, asks each live worker over its channel what only the worker knows (sessions
held, requests running, its event-loop lag; one second at most), and renders. Series
are labelled by worker slot, rule, code or operation, never by session or rollout. A
slot's counters add up every incarnation of the slot, so they never go backwards across
a restart; `gym_proxy_worker_restarts_total` and `gym_proxy_worker_start_time_seconds`
say that one happened. The families are listed in docs/metrics.md; the port they
are served on, and its bounds, is proxy.metrics.listener.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from gym_proxy.coordinator.broadcast import broadcast
from gym_proxy.coordinator.checkpointer import Checkpointer
from gym_proxy.coordinator.contract.channel import ChannelClosed, ChannelTimeout, RemoteError
from gym_proxy.coordinator.contract.loop_lag import LoopLag
from gym_proxy.coordinator.contract.messages import Stats, WorkerStats
from gym_proxy.coordinator.phases import Phase
from gym_proxy.proxy.data_path.client_connection import ProxyState
from gym_proxy.proxy.data_path.routing import RULES
from gym_proxy.proxy.fleet.balance.balancer import Balancer
from gym_proxy.proxy.fleet.moves.mover import Mover
from gym_proxy.proxy.fleet.operations.live import Operations
from gym_proxy.proxy.fleet.supervision.supervisor import Supervisor
from gym_proxy.proxy.fleet.supervision.worker_records import (
    WORKER_STATUSES,
    Slot,
    WorkerProcess,
)
from gym_proxy.proxy.state_tables import WRONG

__all__ = ["Metrics", "STATES", "PHASES"]

log = logging.getLogger("gym_proxy.metrics")

STATES = tuple(s for s in WORKER_STATUSES if s != "stopped")  # of running processes
PHASES: tuple[Phase, ...] = ("idle", "preparing", "prepared", "committed", "restored")
CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
STATS_WAIT = 1.0  # seconds a scrape waits for a worker's stats


class Metrics:
    """The registry and what fills it (the durations' histograms: `proxy.metrics.durations`)."""

    def __init__(
        self,
        state: ProxyState,
        supervisor: Supervisor,
        checkpointer: Checkpointer,
        mover: Mover,
        operations: Operations,
        balancer: Balancer,
        registry: CollectorRegistry,
    ) -> None:
        self.balancer = balancer
        self.state, self.supervisor = state, supervisor
        self.checkpointer, self.mover, self.operations = checkpointer, mover, operations
        self.loop_lag = LoopLag()
        self.worker_stats: dict[str, WorkerStats] = {}
        self.registry = registry  # the durations' histograms are in it already
        ProcessCollector(namespace="gym_proxy", registry=self.registry)
        self.registry.register(_Gathered(self))

    async def refresh(self) -> None:
        """Ask every live worker for its stats (a worker that does not answer in time
        keeps its last ones out: its sessions gauge is absent, not stale)."""
        stats = {}
        for worker, reply in await broadcast(self.supervisor.live(), Stats(), STATS_WAIT):
            if isinstance(reply, WorkerStats):
                stats[worker.owner] = reply
            elif not isinstance(reply, ChannelClosed | ChannelTimeout | RemoteError):
                log.warning("worker %d stats: %r", worker.slot, reply)
        self.worker_stats = stats

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)


class _Gathered(Collector):
    """Everything read at scrape time from the proxy's own state."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._process()
        yield from self._workers()
        yield from self._routing()
        yield from self._checkpoint()
        yield from self._operations()
        yield from self._balance()

    def _process(self) -> Iterator[Metric]:
        state = self.m.state
        yield gauge("gym_proxy_connections", "Open client connections", len(state.clients))
        yield gauge("gym_proxy_connections_max", "Client connection cap", state.max_connections)
        yield gauge(
            "gym_proxy_event_loop_lag_seconds",
            "The proxy's worst event-loop lag since the last scrape",
            self.m.loop_lag.take_worst(),
        )

    def _workers(self) -> Iterator[Metric]:
        sup, stats = self.m.supervisor, self.m.worker_stats
        by_slot: dict[int, list[WorkerProcess]] = {i: [] for i in range(len(sup.slots))}
        for worker in sup.slots.workers():
            if worker.process is not None and worker.state != "dead":
                by_slot.setdefault(worker.slot, []).append(worker)
        families = _WorkerFamilies()
        for slot_index, workers in sorted(by_slot.items()):
            slot = sup.slots[slot_index] if slot_index < len(sup.slots) else None
            families.processes(str(slot_index), workers, slot, stats)
            families.traffic(str(slot_index), workers, slot)
        yield from families.all()

    def _routing(self) -> Iterator[Metric]:
        router, state = self.m.state.router, self.m.state
        decisions = CounterMetricFamily(
            "gym_proxy_routing_decisions",
            "Requests routed, by the rule that decided (docs/http.md: routing order)",
            labels=["rule"],
        )
        for rule in RULES:
            decisions.add_metric([rule], router.decisions.get(rule, 0))
        yield decisions
        yield counter(
            "gym_proxy_foreign_tokens",
            "Requests whose X-NeMo-Gym-Session-Token was not this instance's and named no "
            "session a worker announced: passed to the app untouched",
            router.foreign_tokens,
        )
        errors = CounterMetricFamily(
            "gym_proxy_errors",
            "Answers the proxy gave itself, by error code (docs/http.md)",
            labels=["code"],
        )
        for code, n in sorted(state.errors.items()):
            errors.add_metric([code], n)
        yield errors
        wrong = CounterMetricFamily(
            "gym_proxy_wrong_transitions",
            "State changes the data path's tables do not allow (a gym-proxy bug; logged)",
            labels=["machine"],
        )
        by_machine: dict[str, int] = {"exchange": 0, "client connection": 0}
        for (machine, _, _), n in WRONG.items():
            by_machine[machine] = by_machine.get(machine, 0) + n
        for machine, n in sorted(by_machine.items()):
            wrong.add_metric([machine], n)
        yield wrong
        yield counter(
            "gym_proxy_responses_cut",
            "Responses cut after their first byte (a worker that failed mid-answer)",
            state.responses_cut,
        )
        yield gauge(
            "gym_proxy_sessions_table", "Sessions the session table places", len(router.sessions)
        )

    def _checkpoint(self) -> Iterator[Metric]:
        cp = self.m.checkpointer
        phase = GaugeMetricFamily(
            "gym_proxy_checkpoint_phase",
            "The participant's checkpoint phase (1: current)",
            labels=["phase"],
        )
        for name in PHASES:
            phase.add_metric([name], 1 if cp.machine.phase == name else 0)
        yield phase
        blockers = cp.status().report.blocker_count if cp.machine.is_open else 0
        yield gauge(
            "gym_proxy_checkpoint_blockers", "What keeps an open checkpoint from ready", blockers
        )
        io = cp.io
        records = CounterMetricFamily(
            "gym_proxy_checkpoint_records",
            "Records written by commits and read by restores",
            labels=["direction"],
        )
        records.add_metric(["written"], io.records_written)
        records.add_metric(["read"], io.records_read)
        yield records
        size = CounterMetricFamily(
            "gym_proxy_checkpoint_bytes",
            "Records-file bytes written and read",
            labels=["direction"],
        )
        size.add_metric(["written"], io.bytes_written)
        size.add_metric(["read"], io.bytes_read)
        yield size

    def _operations(self) -> Iterator[Metric]:
        mover = self.m.mover
        yield counter(
            "gym_proxy_sessions_moved", "Sessions moved to another worker", mover.moved_total
        )
        yield counter(
            "gym_proxy_session_move_failures", "Sessions a move did not move", mover.failed_total
        )
        yield counter(
            "gym_proxy_episodes_handed_over",
            "Running /run episodes handed over to another worker",
            mover.episodes_moved_total,
        )
        yield counter(
            "gym_proxy_episode_handover_failures",
            "Running /run episodes an operation could not hand over",
            mover.episodes_failed_total,
        )
        yield gauge(
            "gym_proxy_moving_sessions",
            "Sessions whose requests wait for a move now",
            mover.holding,
        )
        running = GaugeMetricFamily(
            "gym_proxy_live_operation_running",
            "A live operation runs (1), by kind",
            labels=["operation"],
        )
        now = self.m.operations.running
        for kind in ("drain", "undrain", "restart", "resize", "decommission"):
            running.add_metric([kind], 1 if now is not None and now.operation == kind else 0)
        yield running

    def _balance(self) -> Iterator[Metric]:
        balancer = self.m.balancer
        busy = GaugeMetricFamily(
            "gym_proxy_worker_busy_average",
            "Requests the worker runs, averaged over a few seconds (the rebalance's load)",
            labels=["slot", "owner"],
        )
        delay = GaugeMetricFamily(
            "gym_proxy_worker_loop_delay_seconds",
            "How late the worker's event loop answers the supervisor's ping, or the worst lag "
            "it measured itself between two pings, worst lately",
            labels=["slot", "owner"],
        )
        answer = GaugeMetricFamily(
            "gym_proxy_worker_answer_seconds",
            "How long the worker takes to answer, on average lately (in flight over arrivals)",
            labels=["slot", "owner"],
        )
        stalled = GaugeMetricFamily(
            "gym_proxy_worker_stalled",
            "1 while --rebalance takes the worker as stalled (no new sessions)",
            labels=["slot", "owner"],
        )
        for owner, load in sorted(balancer.loads.items(), key=lambda item: item[1].slot):
            labels = [str(load.slot), owner]
            busy.add_metric(labels, load.busy)
            delay.add_metric(labels, load.lag_peak)
            if load.answer_seconds is not None:
                answer.add_metric(labels, load.answer_seconds)
            stalled.add_metric(labels, 1 if owner in balancer.policy.stalled else 0)
        yield busy
        yield delay
        yield answer
        yield stalled
        rebalances = CounterMetricFamily(
            "gym_proxy_rebalances", "Rebalances by reason (hot, stalled)", labels=["reason"]
        )
        moved = CounterMetricFamily(
            "gym_proxy_rebalance_sessions_moved",
            "Idle sessions a rebalance moved, by reason",
            labels=["reason"],
        )
        for reason, count in balancer.rebalances.items():
            rebalances.add_metric([reason], count)
            moved.add_metric([reason], balancer.moved[reason])
        skipped = CounterMetricFamily(
            "gym_proxy_rebalance_skipped",
            "Rebalances not done, by what was in the way",
            labels=["why"],
        )
        for why, count in balancer.skipped.items():
            skipped.add_metric([why], count)
        yield rebalances
        yield moved
        yield skipped
        scaler = balancer.autoscaler
        if scaler is not None:
            scaled = CounterMetricFamily(
                "gym_proxy_autoscale",
                "Resizes the autoscaler made, by direction (up, down)",
                labels=["direction"],
            )
            scaled.add_metric(["up"], scaler.grown)
            scaled.add_metric(["down"], scaler.shrunk)
            yield scaled
            not_done = CounterMetricFamily(
                "gym_proxy_autoscale_skipped",
                "Resizes the autoscaler did not make, by what was in the way",
                labels=["why"],
            )
            for why, count in scaler.skipped.items():
                not_done.add_metric([why], count)
            yield not_done


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class _WorkerFamilies:
    """The families of the worker processes, by slot (`_Gathered._workers`)."""

    def __init__(self) -> None:
        self.states = GaugeMetricFamily(
            "gym_proxy_workers",
            "Worker processes by slot and state (two during a restart of the slot)",
            labels=["slot", "state"],
        )
        self.gauges = {
            name: GaugeMetricFamily(f"gym_proxy_worker_{name}", text, labels=["slot"])
            for name, text in (
                ("requests_in_flight", "Requests routed to the slot's workers and not done"),
                ("sessions", "Live sessions in the slot's workers' stores"),
                ("requests_running", "Requests the slot's workers say they are running"),
                ("resident_memory_bytes", "Resident memory of the slot's workers"),
                ("ping_seconds", "Round trip of the supervisor's last ping"),
                ("event_loop_lag_seconds", "A worker's worst event-loop lag since the last scrape"),
                ("start_time_seconds", "When the slot's current worker started (Unix time)"),
            )
        }
        self.upstream = GaugeMetricFamily(
            "gym_proxy_upstream_connections",
            "Connections to the slot's workers: idle in the pool, connecting, or in use",
            labels=["slot", "state"],
        )
        self.responses = CounterMetricFamily(
            "gym_proxy_worker_responses",
            "Answers of the slot's workers by status class (every incarnation of the slot)",
            labels=["slot", "code_class"],
        )
        self.connect_errors = CounterMetricFamily(
            "gym_proxy_upstream_connect_errors",
            "Failed connections to the slot's workers (every incarnation)",
            labels=["slot"],
        )
        self.restarts = CounterMetricFamily(
            "gym_proxy_worker_restarts",
            "Worker restarts: exit (the supervisor restarted a worker that exited or was "
            "killed) or replaced (a rolling restart or a recycle)",
            labels=["slot", "reason"],
        )
        self.nodes = GaugeMetricFamily(
            "gym_proxy_worker_node",
            "1 for each worker, labelled with the node it runs on (its Ray node ID; `local`: "
            "this machine's process)",
            labels=["slot", "owner", "node"],
        )

    def processes(
        self,
        slot: str,
        workers: list[WorkerProcess],
        current: Slot | None,
        stats: Mapping[str, WorkerStats],
    ) -> None:
        """The slot's processes: their states, nodes, what they report, memory, pings."""
        counts = dict.fromkeys(STATES, 0)
        for worker in workers:
            self.nodes.add_metric([slot, worker.owner, worker.node or "local"], 1)
            if worker.status in counts:
                counts[worker.status] += 1
        for name, n in counts.items():
            self.states.add_metric([slot, name], n)
        gauges = self.gauges
        mine = [stats[w.owner] for w in workers if w.owner in stats]
        if mine:
            gauges["sessions"].add_metric([slot], sum(s.sessions for s in mine))
            gauges["requests_running"].add_metric([slot], sum(s.requests for s in mine))
            lag = max(s.loop_lag_seconds for s in mine)
            gauges["event_loop_lag_seconds"].add_metric([slot], lag)
        memory = [w.memory() for w in workers]  # a placed worker's, as it reported it
        if any(memory):
            gauges["resident_memory_bytes"].add_metric([slot], sum(memory))
        pings = [w.ping_seconds for w in workers if w.ping_seconds is not None]
        if pings:
            gauges["ping_seconds"].add_metric([slot], max(pings))
        newest = current.worker if current is not None else None
        if newest is not None and newest.started_unix:
            gauges["start_time_seconds"].add_metric([slot], newest.started_unix)

    def traffic(self, slot: str, workers: list[WorkerProcess], current: Slot | None) -> None:
        """The slot's requests and connections, its answers, its connect errors and
        restarts (those of its incarnations gone too)."""
        routes = [w.route for w in workers if w.route is not None]
        busy = sum(r.in_flight for r in routes)
        self.gauges["requests_in_flight"].add_metric([slot], busy)
        connecting = sum(len(r.pool.connecting) for r in routes)
        self.upstream.add_metric([slot, "idle"], sum(len(r.pool.idle) for r in routes))
        self.upstream.add_metric([slot, "connecting"], connecting)
        self.upstream.add_metric([slot, "active"], max(0, busy - connecting))
        for i, answer_class in enumerate(CLASSES, start=1):
            total = sum(r.responses[i] for r in routes)
            if current is not None:
                total += current.responses_gone[i]
            self.responses.add_metric([slot, answer_class], total)
        errors = sum(r.pool.connect_errors for r in routes)
        gone = current.connect_errors_gone if current is not None else 0
        self.connect_errors.add_metric([slot], errors + gone)
        self.restarts.add_metric([slot, "exit"], current.restarts if current else 0)
        self.restarts.add_metric([slot, "replaced"], current.replacements if current else 0)

    def all(self) -> Iterator[Metric]:
        yield self.states
        yield from self.gauges.values()
        yield self.upstream
        yield self.responses
        yield self.connect_errors
        yield self.restarts
        yield self.nodes
