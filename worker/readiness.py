"""A worker's readiness for the open checkpoint: the report, and its sending.

The worker is ready when its door is closed and every request in flight is parked at a
boundary, inside a replay step, or waiting at the door. A report carries a sequence
number and the blockers (episode keys, sessions). While a checkpoint is open one is
sent after every change a report shows (`Readiness.changed`, coalesced to one per loop
turn): a request admitted, parked (at the door, at a boundary, for its answer), in or
out of a replay step, turned into a tunnel, or gone (answered, cancelled, retired, a
tunnel closed); a session begun, bound or ended in the store, by a request, the app or
the coordinator (`SessionStore.on_change`). Nothing re-sends them on a timer.

A restart-only participant never blocks, exports nothing, and reports as restarts the
episodes of its live sessions and of its requests in flight; a live session of a
restart-only resources server bound to no episode is state nothing would save or
restart: it is a blocker (`resources-unbound-sessions:<n>`) until it ends. A model's
calls never block: admitted ones finish, and their answers are held until resume.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from gym_proxy.coordinator.contract.channel import ChannelClosed
from gym_proxy.coordinator.contract.messages import Ready, Report

if TYPE_CHECKING:
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["Readiness"]


class Readiness:
    """The readiness reports of one worker's runtime."""

    def __init__(self, runtime: ParticipantRuntime) -> None:
        self.runtime = runtime
        self.seq = 0  # the last report sent
        self._due = False

    def report(self) -> Report:
        """This worker's readiness for the open checkpoint (its sequence number is the last
        report sent)."""
        runtime = self.runtime
        counts = {"in_flight": 0, "running": 0, "door": 0, "parked": 0, "replay": 0, "tunnel": 0}
        blockers = []
        # A model's calls never block: admitted ones finish and their answers are held
        # until resume (`hold_answer`), and the caller repeats an undelivered one.
        restart_only = runtime.participation.restart_only
        never_blocks = restart_only or runtime.kind == "model"
        restarts = set(runtime.store.episodes()) if restart_only else set()
        for flight in runtime.flights:
            counts["in_flight"] += 1
            counts[flight.position] += 1
            # A tunnel blocks until it is gone (closing one takes a moment; "block" waits
            # for the client), except on a restart-only participant, which never blocks.
            if flight.position in ("running", "tunnel") and not never_blocks:
                blockers.append(flight.blocker())
            if restart_only and flight.identity is not None:
                restarts.add(flight.identity.key)
        counts["sessions"] = len(runtime.store)
        if restart_only:
            unbound = runtime.store.unbound()
            counts["unbound_sessions"] = unbound
            if unbound and runtime.kind == "resources":
                blockers.append(f"resources-unbound-sessions:{unbound}")
        return Report(
            seq=self.seq,
            checkpoint_id=runtime.checkpoint_id,
            ready=not runtime.is_open and not blockers,
            blockers=sorted(blockers),
            counts=counts,
            restarts=sorted(restarts),
        )

    def changed(self) -> None:
        """Something readiness depends on changed: report soon (coalesced)."""
        runtime = self.runtime
        if runtime.is_open or self._due or runtime.channel is None:
            return
        self._due = True
        asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._due = False
        channel = self.runtime.channel
        if channel is None or channel.closed or self.runtime.checkpoint_id is None:
            return
        self.seq += 1
        with contextlib.suppress(ChannelClosed):
            channel.notify(Ready(**self.report().fields()))
