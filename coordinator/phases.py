"""The participant's checkpoint phase machine (no I/O, no clock of its own).

    idle -> preparing -> prepared -> committed -> idle      (resume)
    idle -> restored -> idle                                 (resume)

As NeMo Gym's Gen-2 control plane (`nemo_gym/_checkpoint/control.py`) fences calls:

- a completed prepare, commit or restore is remembered per checkpoint ID with the
  arguments it ran with, and returned again on retry before anything else is looked at
  (the deadline included); a retry with another directory or scope is
  `checkpoint_conflict`;
- a recently resumed ID is `stale_checkpoint`; another ID while one is open is
  `checkpoint_conflict`; a call the phase does not allow is `invalid_phase`;
- resume of an ID already resumed answers `idempotent: true`, even while another
  checkpoint is open; resume of an unknown ID while idle is remembered (so a prepare of it
  delayed past the abort cannot close admission) and answers `idempotent: true`;
- retire and forget are allowed in `idle` (under any ID) and in `restored` (under the open
  ID); resume first otherwise.

The lease: a participant left open past its last `deadline_ts` plus the grace resumes
itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from gym_proxy.coordinator.contract.answers import ResumeAnswer
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.ids import is_checkpoint_id
from gym_proxy.coordinator.contract.messages import Message

__all__ = ["PhaseMachine", "Phase", "OPEN_PHASES"]

A = TypeVar("A", bound=Message)

Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]
OPEN_PHASES: frozenset[Phase] = frozenset({"preparing", "prepared", "committed", "restored"})
_REMEMBERED_RESUMES = 256
# The phases each operation may start in.
_ALLOWED = {
    "prepare": frozenset({"idle", "preparing"}),
    "commit": frozenset({"prepared"}),
    "restore": frozenset({"idle"}),
    "renew": OPEN_PHASES,
    "resume": OPEN_PHASES,
    "retire": frozenset({"idle", "restored"}),
    "forget": frozenset({"idle", "restored"}),
}
# Operations that act outside a checkpoint: any ID will do while idle (a straggler policy
# retires with the ID it just resumed); while restored, only the open one.
_OUTSIDE_CHECKPOINTS = frozenset({"retire", "forget"})
# Operations refused once their deadline has passed (a cached reply is returned first).
# Refused when deadline_ts has passed. Not prepare: as in NeMo Gym's Gen-2, a prepare whose
# deadline passed still closes admission and answers at once (`preparing` with its
# blockers, or `prepared`); the controller then resumes or retries.
_DEADLINED = frozenset({"commit", "restore", "retire", "forget"})


@dataclass
class PhaseMachine:
    """Phase, checkpoint ID, lease and reply cache of the one participant."""

    lease_grace: float
    phase: Phase = "idle"
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    replies: dict[str, tuple[Any, Message]] = field(default_factory=dict)
    resumed: OrderedDict[str, None] = field(default_factory=OrderedDict)
    on_open: Callable[[str], None] | None = None  # called as a checkpoint opens
    on_idle: Callable[[], None] | None = None  # called as it goes back to idle

    @property
    def is_open(self) -> bool:
        return self.phase in OPEN_PHASES

    def check(
        self, op: str, checkpoint_id: str, deadline_ts: float, now: float, arguments: Any = None
    ) -> Message | None:
        """Validate `op`; return a reply to send again (retry), None to go on, or raise."""
        if not is_checkpoint_id(checkpoint_id):
            raise GymError("invalid_request", "checkpoint_id is malformed")
        if checkpoint_id == self.checkpoint_id and op in self.replies:
            ran_with, reply = self.replies[op]
            if ran_with != arguments:
                raise GymError(
                    "checkpoint_conflict",
                    f"checkpoint {checkpoint_id} already completed {op} with another "
                    "directory or scope",
                )
            return reply
        if op == "resume":
            if checkpoint_id in self.resumed:
                return ResumeAnswer("idle", True)
            if not self.is_open:
                # A prepare that never reached this participant: fence its ID anyway.
                self.remember(checkpoint_id)
                return ResumeAnswer("idle", True)
        outside = op in _OUTSIDE_CHECKPOINTS
        if outside and self.phase not in _ALLOWED[op]:
            detail = f"{op} is not valid in phase {self.phase}; resume first"
            raise GymError("invalid_phase", detail)
        if checkpoint_id in self.resumed and not outside:
            raise GymError("stale_checkpoint", f"checkpoint {checkpoint_id} was already resumed")
        if self.checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            raise GymError(
                "checkpoint_conflict",
                f"checkpoint {self.checkpoint_id} is open in phase {self.phase}",
            )
        if self.phase not in _ALLOWED[op]:
            raise GymError("invalid_phase", f"{op} is not valid in phase {self.phase}")
        if op in _DEADLINED and deadline_ts <= now:
            raise GymError("deadline_exceeded", "deadline_ts is already in the past")
        return None

    def open(self, checkpoint_id: str, phase: Phase, deadline_ts: float) -> None:
        """Enter `phase` for a new checkpoint ID."""
        self.checkpoint_id = checkpoint_id
        self.phase = phase
        self.replies = {}
        self.lease_expires_at = None
        self.extend(deadline_ts)
        if self.on_open is not None:
            self.on_open(checkpoint_id)

    def extend(self, deadline_ts: float) -> None:
        """Move the lease to `deadline_ts` + grace (never backwards)."""
        expires = deadline_ts + self.lease_grace
        if self.lease_expires_at is None or expires > self.lease_expires_at:
            self.lease_expires_at = expires

    def succeed(self, op: str, phase: Phase, reply: A, arguments: Any = None) -> A:
        """`op` succeeded: enter `phase` and remember `reply` (and its arguments) for retries."""
        self.phase = phase
        self.replies[op] = (arguments, reply)
        return reply

    def remember(self, checkpoint_id: str) -> None:
        """Refuse `checkpoint_id` from now on (the last few hundred are kept)."""
        self.resumed[checkpoint_id] = None
        self.resumed.move_to_end(checkpoint_id)
        while len(self.resumed) > _REMEMBERED_RESUMES:
            self.resumed.popitem(last=False)

    def close(self) -> str | None:
        """Back to idle (resume, abort or lease expiry); returns the ID that was open."""
        closed = self.checkpoint_id
        if closed is not None:
            self.remember(closed)
        self.abandon()
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
        if self.on_idle is not None:
            self.on_idle()

    def lease_expired(self, now: float) -> bool:
        """True when an open checkpoint outlived its lease."""
        return self.is_open and self.lease_expires_at is not None and now > self.lease_expires_at
