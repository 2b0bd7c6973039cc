"""Sessions that end in a worker: the app's `release` hook drops their state, and the
proxy is told soon, in one batch, so that its routing table of app and placed sessions
does not keep them forever (an MCP token or cookie of an ended session is then routed as
a new one). Whatever ends them (a closer, the idle TTL, a retire, a release after a
commit, a move) ends them in the store (`SessionStore.on_end`); with
`--session-idle-ttl`, `SessionEnds.expire` ends the idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from gym_proxy.coordinator.contract.channel import ChannelClosed
from gym_proxy.coordinator.contract.messages import SessionsEnded

if TYPE_CHECKING:
    from gym_proxy.worker.runtime import ParticipantRuntime

__all__ = ["SessionEnds", "ENDED_FLUSH"]

# Seconds ended sessions are collected before the proxy is told. A batching delay, not a
# poll: the first session that ends starts one timer, which sends the batch and stops; a
# worker whose sessions do not end runs none. Readiness never waits on it (`changed`).
ENDED_FLUSH = 0.2


class SessionEnds:
    """The ends of one worker's sessions (the module docstring)."""

    def __init__(self, runtime: ParticipantRuntime) -> None:
        self.runtime = runtime
        self._ended: list[str] = []  # not told to the proxy yet

    def ended(self, session_ids: list[str]) -> None:
        """The store ended these sessions (its `on_end`)."""
        runtime = self.runtime
        hooks = runtime.participation.hooks
        if hooks is not None and hooks.release is not None:
            hooks.release(session_ids)
        for session_id in session_ids:
            runtime.links.pop(session_id, None)
        if not self._ended:
            with contextlib.suppress(RuntimeError):  # no loop: nobody to tell
                asyncio.get_running_loop().call_later(ENDED_FLUSH, self._send)
        self._ended += session_ids

    def _send(self) -> None:
        ended, self._ended = self._ended, []
        runtime = self.runtime
        ended = [sid for sid in ended if sid not in runtime.store]  # begun again meanwhile: keep
        channel = runtime.channel
        if ended and channel is not None and not channel.closed:
            with contextlib.suppress(ChannelClosed):
                channel.notify(SessionsEnded(ended))

    async def expire(self, ttl: float) -> None:
        """End sessions idle for `ttl` seconds, now and then (never while closed: the
        state a checkpoint exports stays as it was at close)."""
        runtime = self.runtime
        while True:
            await asyncio.sleep(min(ttl / 4, 10.0))
            if runtime.is_open:
                busy = {f.key for f in runtime.flights if f.key is not None}
                runtime.store.expire(time.monotonic() - ttl, busy)
