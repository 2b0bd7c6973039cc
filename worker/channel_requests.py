"""What a worker does with each coordinator request (the worker end of the channel)."""

from __future__ import annotations

import time
from typing import Any

from gym_proxy.coordinator.contract import failpoints, records, telemetry
from gym_proxy.coordinator.contract.collector import collector_paused
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.marks import RestoredClaims
from gym_proxy.coordinator.contract.messages import (
    Close,
    CloseReply,
    CloseTunnels,
    Done,
    Drop,
    Export,
    ExportReply,
    Forget,
    Forgotten,
    GiveUp,
    HeldSessions,
    Install,
    Installed,
    LinkedSessions,
    Links,
    ListHeld,
    Message,
    MoveIn,
    MoveOut,
    ParkEpisodes,
    Release,
    Released,
    Reopen,
    ResumeEpisodes,
    Retire,
    Retired,
    SessionRecords,
    Stats,
    Stop,
    Tables,
    TablesUpdate,
    Uninstall,
    WorkerStats,
)
from gym_proxy.coordinator.contract.telemetry import ATTRIBUTE
from gym_proxy.worker import attempts, handovers, state_records
from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["handle_coordinator_message", "apply_tables"]


async def handle_coordinator_message(runtime: ParticipantRuntime, message: Message) -> Message:
    """Serve one request from the coordinator; a GymError becomes a typed `error` reply.
    A checkpoint step is a span, the child of the coordinator's (telemetry)."""
    step = STEPS.get(message.TYPE)
    if step is None or not telemetry.enabled():
        return await _handle(runtime, message)
    with telemetry.span(f"gym.checkpoint.{step}") as traced:
        reply = await _handle(runtime, message)
        traced.set_attributes(_step_attributes(runtime, message, reply))
        return reply


# NeMo Gym's span names for the steps a worker does.
STEPS = {
    "close": "wait_ready",
    "export": "export",
    "install": "install",
    "reopen": "resume",
    "retire": "retire",
    "forget": "forget",
}


def _step_attributes(
    runtime: ParticipantRuntime, message: Message, reply: Message
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        ATTRIBUTE + "participant_kind": runtime.kind,
        "gym_proxy.slot": runtime.info.slot,
    }
    match reply:
        case ExportReply():
            attributes[ATTRIBUTE + "records"] = reply.count
            attributes[ATTRIBUTE + "bytes"] = len(reply.blob)
        case Installed():
            attributes[ATTRIBUTE + "records"] = reply.installed
        case CloseReply():
            attributes[ATTRIBUTE + "blockers"] = len(reply.report.blockers)
        case Retired():
            attributes[ATTRIBUTE + "episodes"] = len(getattr(message, "episode_ids", ()))
        case Forgotten():
            attributes[ATTRIBUTE + "rollouts"] = len(reply.forgotten)
    return attributes


async def _handle(runtime: ParticipantRuntime, message: Message) -> Message:
    match message:
        case Close():
            runtime.close_door(message.checkpoint_id)
            return CloseReply(runtime.readiness.report())
        case Reopen():
            runtime.open_door()
            return Done()
        case Export():
            # Encoded here, as the records file holds them: the coordinator only joins bytes.
            with collector_paused():
                encoded = records.encode(await _export(runtime, message), message.kind)
            return ExportReply(encoded.data, encoded.count, sorted(encoded.keys))
        case Release():
            dropped = runtime.store.release(set(message.keep))
            return Released(await state_records.forget_sessions(runtime, dropped))
        case Install():
            with collector_paused():
                sessions = records.restored_sessions(
                    bytes(message.blob), message.identities, message.numbers, message.source
                )
                return Installed(await state_records.install(runtime, sessions))
        case Uninstall():
            runtime.claims.clear()
            return Released(await state_records.forget_sessions(runtime, runtime.store.uninstall()))
        case TablesUpdate():  # a restore, or its rollback
            apply_tables(runtime, message)
            return Done()
        case Retire():
            episodes = [EpisodeId(e.rollout_id, e.attempt) for e in message.episode_ids]
            return Retired(await attempts.retire(runtime, episodes))
        case Forget():
            return Forgotten(attempts.forget(runtime, message.rollout_ids))
        case Stop():
            await state_records.stop(runtime)
            return Done()
        case LinkedSessions():
            links = runtime.links
            return Links({s: sorted(links[s]) for s in message.session_ids if s in links})
        case MoveOut():
            moving = await state_records.export_sessions(runtime, message.session_ids)
            failpoints.hit("worker-move-out")  # the source dies before it answers
            return SessionRecords(moving)
        case MoveIn():
            installed = await state_records.install(runtime, message.sessions, restored=False)
            handovers.receive_episodes(runtime, message.episodes)
            failpoints.hit("worker-installed")  # the target dies after installing
            return Installed(installed)
        case Drop():
            for key in message.episode_keys:
                runtime.arrivals.pop(key, None)
            return Released(await state_records.drop_sessions(runtime, message.session_ids))
        case ParkEpisodes():
            return await handovers.park_episodes(runtime, message.keys, message.within)
        case GiveUp():
            gave_up = await handovers.give_up(runtime, message.handovers)
            failpoints.hit("worker-gave-up")  # the source dies after answering the markers
            return gave_up
        case ResumeEpisodes():
            handovers.resume_episodes(runtime, message.keys)
            return Done()
        case CloseTunnels():
            runtime.close_tunnels(set(message.session_ids))
            return Done()
        case Stats():
            lag = runtime.loop_lag.take_worst()
            return WorkerStats(len(runtime.store), len(runtime.flights), lag)
        case ListHeld():
            delay, busy = runtime.load.recent(time.monotonic(), runtime.flights)
            return HeldSessions(
                runtime.store.session_ids(),
                not runtime.participation.restart_only,
                len(runtime.flights),
                handovers.running_episodes(runtime),
                delay,
                busy,
            )
    raise GymError("invalid_request", f"{message.TYPE} is not a message for a worker")


def apply_tables(runtime: ParticipantRuntime, tables: Tables) -> None:
    """The coordinator's pending claims replace the worker's; its marks are merged in."""
    runtime.claims = RestoredClaims(
        {rid: (attempt, None) for rid, attempt in tables.pending.items()}
    )
    runtime.marks.merge(tables.marks)


async def _export(runtime: ParticipantRuntime, message: Export) -> list[dict[str, Any]]:
    if message.checkpoint_id != runtime.checkpoint_id:
        raise GymError(
            "stale_checkpoint",
            f"export for {message.checkpoint_id}, open is {runtime.checkpoint_id}",
        )
    report = runtime.readiness.report()
    if not report.ready:
        raise GymError("invalid_phase", f"not ready: {', '.join(report.blockers[:5])}")
    scope = set(message.scope) if message.scope is not None else None
    return await state_records.export(runtime, scope)
