"""Every error code gym-proxy answers, its HTTP status, and the one body shape.

A refusal anywhere (the data path, the participant runtime in a worker, the control
plane, the coordinator channel) is a `GymError(code, detail)`; its HTTP status comes
from `STATUS`, so a code can never be answered with two different statuses. Over the
coordinator channel an error travels as `{code, detail}` and is raised again as the
same `GymError` on the other side.
"""

from __future__ import annotations

import orjson

__all__ = ["STATUS", "RETRY_AFTER", "GymError", "WorkerGone", "error_body", "status_of"]

STATUS: dict[str, int] = {
    # the data path
    "bad_request": 400,
    "invalid_session_token": 400,
    "not_found": 404,
    "unknown_session": 404,
    "request_timeout": 408,
    "session_owner_gone": 410,
    "uri_too_long": 414,
    "headers_too_large": 431,
    "upgrade_not_supported": 501,
    "unsupported_transfer_coding": 501,
    "upstream_connection_lost": 502,
    "upstream_protocol_error": 502,
    "worker_unavailable": 503,
    "too_many_connections": 503,
    "upstream_timeout": 504,
    "http_version_not_supported": 505,
    # the participant runtime and the control plane
    "invalid_request": 400,
    "rollout_id_required": 400,
    "unauthorized": 401,
    "method_not_allowed": 405,
    "request_too_large": 413,
    "checkpoint_parked": 409,
    "stale_attempt": 409,
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "deadline_exceeded": 409,
    "restart_in_scope": 409,
    "operation_conflict": 409,
    "session_not_movable": 409,
    "invalid_checkpoint_state": 422,
    "internal_error": 500,
    "checkpoint_write_failed": 500,
    "unexportable_state": 500,
    "checkpoint_coordinator_unavailable": 503,
    "server_stopping": 503,
}

# Codes whose answer carries `Retry-After: 1`: the same request may succeed shortly.
RETRY_AFTER = frozenset({"checkpoint_parked", "worker_unavailable", "too_many_connections"})


def status_of(code: str) -> int:
    """The HTTP status of `code` (500 for a code this table does not know)."""
    return STATUS.get(code, 500)


def error_body(code: str, detail: str) -> bytes:
    """`{"error": {"code", "detail"}}` as JSON bytes."""
    return orjson.dumps({"error": {"code": code, "detail": detail}})


class WorkerGone(ConnectionRefusedError):
    """A worker's connector found the worker gone (a placed worker's port refuses): the
    request that asked is answered as its session's worker being gone (410), not 502,
    though the router hears of it an instant later."""


class GymError(Exception):
    """A refusal with a code from `STATUS` and a detail for the human reading it."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    @property
    def status(self) -> int:
        return status_of(self.code)

    def body(self) -> bytes:
        return error_body(self.code, self.detail)
