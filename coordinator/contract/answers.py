"""What gym-proxy's control plane answers, typed: a checkpoint call (NeMo Gym's Gen-2
replies), a move, a live operation, and `status`. The server builds these and renders
each with `as_json`; its clients (`gym-proxy-ctl`, `coordinator.clients`) read them
back with `read_answer` from the same definitions, leniently: another participant (a
NeMo Gym server) may add keys of its own, which are left out, while what is defined
here is checked as the channel checks its messages.

An answer is a `Message` of the channel's kind (frozen, typed, decoded field by field),
registered nowhere: it has no wire type. A field listed in an answer's `OMIT_NONE` is
left out of its JSON while it is None (an operation's slot entries name only what
happened to the slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar, Literal, TypeVar

from gym_proxy.coordinator.contract.messages import MalformedMessage, Message, message

__all__ = [
    "AnswerError",
    "read_answer",
    "ReadinessReport",
    "NOT_OPEN",
    "PrepareAnswer",
    "Manifest",
    "CommitAnswer",
    "RestoreAnswer",
    "ResumeAnswer",
    "RenewAnswer",
    "RetireAnswer",
    "ForgetAnswer",
    "WorkerLoadView",
    "WorkerStatus",
    "Rebalance",
    "RebalanceStatus",
    "NotMoved",
    "EpisodeNotHandedOver",
    "EpisodeHandedOver",
    "SlotOutcome",
    "OperationReport",
    "OperationsStatus",
    "MoveAnswer",
    "ServerStatus",
]

A = TypeVar("A", bound=Message)


class AnswerError(ValueError):
    """An answer that is not the one its call has (names the call and what is wrong)."""


def read_answer(definition: type[A], payload: object, call: str) -> A:
    """The answer of `call` in `payload` (a parsed JSON body); AnswerError otherwise."""
    if not isinstance(payload, Mapping):
        raise AnswerError(f"{call} answered {type(payload).__name__}, not a JSON object")
    try:
        return definition.decode(payload, strict=False)
    except (MalformedMessage, TypeError) as exc:
        raise AnswerError(f"{call} answered what this client cannot read: {exc}") from None


class _Omitting(Message):
    """An answer that leaves out its `OMIT_NONE` fields while they are None."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    def as_json(self) -> dict[str, Any]:
        omit = self.OMIT_NONE
        return {k: v for k, v in self.fields().items() if v is not None or k not in omit}


# ---- checkpoints ----------------------------------------------------------------------
@message()
class ReadinessReport(Message):
    """Whether the participant is ready for the open checkpoint, and what blocks it
    (`blockers` at most 100; `blocker_count` counts them all; `restarts` never capped)."""

    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[str]


NOT_OPEN = ReadinessReport(False, [], 0, {}, [])  # no checkpoint is open


@message()
class PrepareAnswer(Message):
    phase: Literal["preparing", "prepared"]
    report: ReadinessReport


@message()
class Manifest(Message):
    """A checkpoint's manifest, as its commit answers it (`checkpoint_files`): NeMo
    Gym's fields, and gym-proxy's tables (NeMo Gym's own name owners in a list)."""

    schema_version: int
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    session_owners: dict[str, str] | list[str] = field(default_factory=dict)
    assigned_sessions: dict[str, str] | None = None
    assigned_app_sessions: dict[str, str] | None = None


@message()
class CommitAnswer(Message):
    phase: Literal["committed"]
    manifest: Manifest
    episode_ids: list[str]  # the capture keys it exported


@message()
class RestoreAnswer(Message):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]  # capture keys of the attempts that continue (N+1)


@message()
class ResumeAnswer(Message):
    phase: Literal["idle"]
    idempotent: bool


@message()
class RenewAnswer(Message):
    lease_expires_at: float | None
    phase: str = ""  # gym-proxy says it; NeMo Gym's servers answer the lease alone


@message()
class RetireAnswer(Message):
    retired: list[str]


@message()
class ForgetAnswer(Message):
    forgotten: list[str]


# ---- moves and live operations -----------------------------------------------------------
@message()
class NotMoved(Message):
    session_id: str
    reason: str


@message()
class MoveAnswer(Message):
    to_slot: int
    moved: list[str]
    failed: list[NotMoved]
    seconds: float


@message()
class EpisodeNotHandedOver(Message):
    episode: str
    reason: str


@message()
class EpisodeHandedOver(Message):
    episode: str
    owner: str  # the worker that has it now


@message()
class SlotOutcome(_Omitting):
    """What an operation did to one slot: only what happened is said."""

    OMIT_NONE = frozenset(
        {
            "owner",
            "draining",
            "sessions_left",
            "episodes_left",
            "added",
            "removed",
            "outcome",
            "old_owner",
            "old_pid",
            "new_owner",
            "new_pid",
        }
    )

    slot: int
    owner: str | None = None
    draining: bool | None = None
    sessions_left: int | None = None
    episodes_left: int | None = None
    added: bool | None = None
    removed: bool | None = None
    outcome: str | None = None
    old_owner: str | None = None
    old_pid: int | None = None
    new_owner: str | None = None
    new_pid: int | None = None


@message()
class OperationReport(_Omitting):
    """A live operation as it runs (`status`) and as its call answers it once it ended
    (`complete`, and a resize's `workers` and `gave_way`)."""

    OMIT_NONE = frozenset({"complete", "workers", "gave_way"})

    operation: str
    reason: str
    started_at: float  # Unix seconds
    step: str
    detail: str
    step_slot: int | None
    moved: int
    failed: list[NotMoved]
    episodes_moved: int
    episodes_failed: list[EpisodeNotHandedOver]
    episodes_handed_over: list[EpisodeHandedOver]
    slots: list[SlotOutcome]
    errors: list[str]
    seconds: float | None
    waiting: int  # sessions whose requests wait at the proxy now
    complete: bool | None = None
    workers: int | None = None
    gave_way: bool | None = None


@message()
class OperationsStatus(Message):
    running: OperationReport | None
    last: OperationReport | None


# ---- status ------------------------------------------------------------------------------
@message()
class WorkerLoadView(Message):
    busy_average: float
    answer_s: float | None
    loop_delay_s: float
    stalled: bool


@message()
class WorkerStatus(Message):
    """One registered worker: the checkpoint's view, the fleet's and its load."""

    slot: int
    owner: str
    pid: int
    in_flight: int
    ready: bool | None  # None: it has not reported for the open checkpoint
    state: str = ""
    requests_served: int = 0
    node: str = ""  # a Ray node ID, or `local`
    address: str = ""
    load: WorkerLoadView | None = None  # None before its first sample
    memory_bytes: int = 0  # resident; a placed worker's as it reported it (0: not known)
    restarts: int = 0  # of its slot, after an exit
    sessions: int = 0  # it holds, as it said at its last liveness ping (every second)


@message()
class Rebalance(Message):
    at: float  # Unix seconds
    slot: int
    owner: str
    reason: str
    why: str
    moved: dict[str, str]  # session -> the owner it went to
    not_moved: dict[str, str]  # session -> why
    kept: dict[str, str]  # idle sessions kept because they carry the load -> why


@message()
class RebalanceStatus(Message):
    acting: bool
    stalled_slots: list[int]
    recent: list[Rebalance]


@message()
class CheckpointDone(Message):
    """A commit or a restore this process finished: which checkpoint, when (Unix
    seconds) and how many records it wrote or read."""

    checkpoint_id: str
    at: float
    records: int


@message()
class AutoscaleDecision(Message):
    """The autoscaler's latest resize decision: from `workers_from` to `workers_to`, why,
    and what came of it (`made`, or why it was skipped or not done)."""

    at: float  # Unix seconds
    workers_from: int
    workers_to: int
    why: str
    outcome: str


@message()
class AutoscaleStatus(Message):
    """`--min-workers`/`--max-workers`, and the latest decision (None before one)."""

    least: int
    most: int
    last: AutoscaleDecision | None = None


@message()
class ServerStatus(Message):
    """`status`: NeMo Gym's fields, then gym-proxy's."""

    kind: str | None
    instance: str
    phase: str
    checkpoint_id: str | None
    lease_expires_at: float | None
    report: ReadinessReport
    retired_rollouts: int
    restored_pending: list[str] = field(default_factory=list)
    workers: list[WorkerStatus] = field(default_factory=list)
    expected_workers: int = 0
    session_aliases: dict[str, str] | None = None
    routed_sessions: int = 0
    operation: str | None = None
    moving_sessions: int = 0
    operations: OperationsStatus | None = None
    rebalance: RebalanceStatus | None = None
    autoscale: AutoscaleStatus | None = None
    last_commit: CheckpointDone | None = None
    last_restore: CheckpointDone | None = None
