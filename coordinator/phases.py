"""The participant's checkpoint phase machine (no I/O, no clock of its own).

    idle -> preparing -> prepared -> committed -> idle      (resume)
    idle -> restored -> idle                                 (resume)

Resume doubles as abort from any open phase. A successful prepare, commit or restore is
remembered per checkpoint ID and returned again on retry; a recently resumed ID is
`stale_checkpoint`; another ID while one is open is `checkpoint_conflict`. The lease: a
participant left open past its last `deadline_ts` plus the grace resumes itself.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import GymError

__all__ = ["PhaseMachine", "CHECKPOINT_ID", "OPEN_PHASES"]

CHECKPOINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
OPEN_PHASES = frozenset({"preparing", "prepared", "committed", "restored"})
_REMEMBERED_RESUMES = 256


@dataclass
class PhaseMachine:
    """Phase, checkpoint ID, lease and reply cache of the one participant."""

    lease_grace: float
    phase: str = "idle"
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    resumed: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def is_open(self) -> bool:
        return self.phase in OPEN_PHASES

    def check(self, op: str, checkpoint_id: str, deadline_ts: float, now: float) -> dict | None:
        """Validate `op`; return a reply to send again (retry), None to go on, or raise."""
        if not CHECKPOINT_ID.match(checkpoint_id):
            raise GymError("invalid_request", "checkpoint_id is malformed")
        if op != "resume" and deadline_ts <= now:
            raise GymError("deadline_exceeded", "deadline_ts is already in the past")
        if checkpoint_id == self.checkpoint_id and op in self.replies:
            return self.replies[op]
        if not self.is_open:
            if op == "resume":
                return {"phase": "idle", "idempotent": True}
            if checkpoint_id in self.resumed:
                raise GymError(
                    "stale_checkpoint", f"checkpoint {checkpoint_id} was already resumed"
                )
            if op in ("prepare", "restore"):
                return None
            raise GymError("invalid_phase", f"{op} needs an open checkpoint")
        if checkpoint_id != self.checkpoint_id:
            raise GymError("checkpoint_conflict", f"checkpoint {self.checkpoint_id} is open")
        allowed = {
            "prepare": ("preparing", "prepared"),
            "commit": ("preparing", "prepared"),
            "renew": tuple(OPEN_PHASES),
            "resume": tuple(OPEN_PHASES),
            "restore": (),
        }[op]
        if self.phase not in allowed:
            raise GymError("invalid_phase", f"{op} is not allowed in phase {self.phase}")
        return None

    def open(self, checkpoint_id: str, phase: str, deadline_ts: float) -> None:
        """Enter `phase` for a new checkpoint ID."""
        self.checkpoint_id = checkpoint_id
        self.phase = phase
        self.replies = {}
        self.lease_expires_at = None
        self.extend(deadline_ts)

    def extend(self, deadline_ts: float) -> None:
        """Move the lease to `deadline_ts` + grace (never backwards)."""
        expires = deadline_ts + self.lease_grace
        if self.lease_expires_at is None or expires > self.lease_expires_at:
            self.lease_expires_at = expires

    def succeed(self, op: str, phase: str, reply: dict[str, Any]) -> dict[str, Any]:
        """`op` succeeded: enter `phase` and cache `reply` for retries of this ID."""
        self.phase = phase
        self.replies[op] = reply
        return reply

    def close(self) -> str | None:
        """Back to idle (resume, abort or lease expiry); returns the ID that was open."""
        closed = self.checkpoint_id
        if closed is not None:
            self.resumed[closed] = None
            self.resumed.move_to_end(closed)
            while len(self.resumed) > _REMEMBERED_RESUMES:
                self.resumed.popitem(last=False)
        self.phase = "idle"
        self.checkpoint_id = None
        self.lease_expires_at = None
        self.replies = {}
        return closed

    def unprepare(self) -> None:
        """Readiness was lost after prepare succeeded: back to preparing, and a retried
        prepare waits again instead of returning the stale `prepared` reply."""
        if self.phase == "prepared":
            self.phase = "preparing"
            self.replies.pop("prepare", None)

    def abandon(self) -> None:
        """Back to idle without remembering the ID (a restore that installed nothing)."""
        self.phase = "idle"
        self.checkpoint_id = None
        self.lease_expires_at = None
        self.replies = {}

    def lease_expired(self, now: float) -> bool:
        """True when an open checkpoint outlived its lease."""
        return self.is_open and self.lease_expires_at is not None and now > self.lease_expires_at
