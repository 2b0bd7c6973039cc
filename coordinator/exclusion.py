"""The one exclusion checkpoints and live operations share.

A checkpoint (from its prepare to its resume, or a restore) and a move or live operation
(a drain, resize, restart, recycle, a decommission that finishes late) never overlap: a
checkpoint must see every session where it is, and an operation must not move what a
checkpoint is exporting. Whichever comes second is refused 409 `operation_conflict`,
naming what is in the way; nothing waits, so a controller decides when to retry.

The open checkpoint is the phase machine's (asked, never copied); the running operation
is the one state kept here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gym_proxy.coordinator.contract.errors import GymError

__all__ = ["Exclusion"]


@dataclass(eq=False)
class Exclusion:
    open_checkpoint: Callable[[], str | None]  # the checkpoint open now, if one is
    operation: str | None = None  # the move or live operation running, if one is

    def is_free(self) -> bool:
        """No checkpoint open and no move or operation running."""
        return self.operation is None and self.open_checkpoint() is None

    def refuse_operation(self, kind: str) -> None:
        """409 naming what is in the way of an operation of `kind`, if anything is."""
        open_id = self.open_checkpoint()
        if open_id is not None:
            raise GymError(
                "operation_conflict", f"checkpoint {open_id} is open; a {kind} waits for its resume"
            )
        self.refuse_checkpoint()

    def refuse_checkpoint(self) -> None:
        """409 if a move or operation runs (a prepare or a restore would see it half done)."""
        if self.operation is not None:
            raise GymError("operation_conflict", f"a {self.operation} is running; retry after it")

    @contextlib.contextmanager
    def hold(self, kind: str) -> Iterator[None]:
        """Run an operation of `kind`, refused (above) unless everything is free."""
        self.refuse_operation(kind)
        self.operation = kind
        try:
            yield
        finally:
            self.operation = None
