"""What a worker does with each coordinator request (the worker end of the channel)."""

from __future__ import annotations

from typing import Any

from coordinator.contract import records
from coordinator.contract.episodes import EpisodeId
from coordinator.contract.errors import GymError
from worker.runtime import ParticipantRuntime

__all__ = ["handle_coordinator_message"]


async def handle_coordinator_message(
    runtime: ParticipantRuntime, message: dict[str, Any]
) -> dict[str, Any]:
    """Serve one request from the coordinator; a GymError becomes a typed `error` reply."""
    kind = message["type"]
    if kind == "close":
        runtime.close_gate(message["checkpoint_id"])
        return {"report": {**runtime.report(), "seq": runtime.seq}}
    if kind == "reopen":
        runtime.open_gate()
        return {}
    if kind == "export":
        # Encoded here, as the records file holds them: the coordinator only joins bytes.
        encoded = records.encode(await _export(runtime, message), message["kind"])
        return {"blob": encoded.data, "count": encoded.count, "keys": sorted(encoded.keys)}
    if kind == "release":
        dropped = runtime.store.release(set(message["keep"]))
        return {"released": await runtime.forget_sessions(dropped)}
    if kind == "install":
        return {"installed": await runtime.install(message["sessions"])}
    if kind == "uninstall":
        runtime.pending.clear()
        return {"released": await runtime.forget_sessions(runtime.store.uninstall())}
    if kind == "tables":
        runtime.aliases = dict(message["aliases"])
        runtime.sessions = dict(message["sessions"])
        runtime.pending = {str(k): int(v) for k, v in message["pending"].items()}
        for rollout_id, attempt in message.get("marks", {}).items():
            runtime.marks[rollout_id] = max(runtime.marks.get(rollout_id, -1), int(attempt))
        return {}
    if kind == "retire":
        episodes = [EpisodeId(e["rollout_id"], int(e["attempt"])) for e in message["episode_ids"]]
        return {"retired": await runtime.retire(episodes)}
    if kind == "forget":
        return {"forgotten": runtime.forget(list(message["rollout_ids"]))}
    if kind == "stop":
        await runtime.stop()
        return {}
    raise GymError("invalid_request", f"unknown message type {kind!r}")


async def _export(runtime: ParticipantRuntime, message: dict[str, Any]) -> list[dict[str, Any]]:
    if message.get("checkpoint_id") != runtime.checkpoint_id:
        raise GymError(
            "stale_checkpoint",
            f"export for {message.get('checkpoint_id')}, open is {runtime.checkpoint_id}",
        )
    report = runtime.report()
    if not report["ready"]:
        raise GymError("invalid_phase", f"not ready: {', '.join(report['blockers'][:5])}")
    scope = set(message["scope"]) if message.get("scope") is not None else None
    return await runtime.export(scope)
