"""What a worker does with each coordinator request (the worker end of the channel)."""

from __future__ import annotations

from typing import Any

from worker.participant import ParticipantRuntime

__all__ = ["handle_coordinator_message"]


async def handle_coordinator_message(
    runtime: ParticipantRuntime, message: dict[str, Any]
) -> dict[str, Any]:
    """Serve one request from the coordinator; an exception becomes an `error` reply."""
    kind = message["type"]
    if kind == "close":
        runtime.close_gate(message["checkpoint_id"])
        return {"report": {**runtime.report(), "seq": runtime.seq}}
    if kind == "reopen":
        runtime.open_gate()
        return {}
    if kind == "export":
        return {"records": _export(runtime, message)}
    if kind == "release":
        return {"released": runtime.store.release(set(message["keep"]))}
    if kind == "install":
        return {"installed": runtime.store.install(message["sessions"])}
    if kind == "uninstall":
        runtime.pending.clear()
        return {"released": runtime.store.uninstall()}
    if kind == "tables":
        runtime.aliases = dict(message["aliases"])
        runtime.sessions = dict(message["sessions"])
        runtime.pending = {str(k): int(v) for k, v in message["pending"].items()}
        return {}
    if kind == "retire":
        return {"retired": await runtime.retire(set(message["episodes"]))}
    raise ValueError(f"unknown message type {kind!r}")


def _export(runtime: ParticipantRuntime, message: dict[str, Any]) -> list[dict[str, Any]]:
    if message.get("checkpoint_id") != runtime.checkpoint_id:
        raise ValueError(
            f"export for {message.get('checkpoint_id')}, open is {runtime.checkpoint_id}"
        )
    report = runtime.report()
    if not report["ready"]:
        raise ValueError(f"not ready: {', '.join(report['blockers'][:5])}")
    scope = set(message["scope"]) if message.get("scope") is not None else None
    records = runtime.store.export(runtime.info.owner, scope)
    for flight in runtime.flights:
        ep = flight.episode
        if ep is not None and (scope is None or ep.key in scope):
            records.append(ep.export())
    return records
