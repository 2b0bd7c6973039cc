"""Waiting for a session's or a worker's requests to end, woken by the data path.

A move waits until a moving session has no request running; a hand-over until an
episode's riders run only the episode's own request; a decommission until the worker it
empties has none (`worker_watch`). None of them polls: the wait registers a future under
its keys in `Router.watchers`, the data path resolves it as a request of one of them ends
(`proxy.data_path.exchange`), and the waiter looks again at what it needs. An operation
that gives way (`coordinator.exclusion.Exclusion.asked`) is woken as it is asked to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

from gym_proxy.proxy.data_path.routing import Router, worker_watch

__all__ = ["until_a_request_ends", "worker_watch"]


async def until_a_request_ends(
    router: Router,
    session_ids: Iterable[str],
    deadline: float,
    asked: asyncio.Future[None] | None = None,
) -> None:
    """Until a request of one of `session_ids` (or of a worker, `worker_watch`) ends,
    `deadline` (time.monotonic()), or `asked` is done (the waiter gives way)."""
    if asked is not None and asked.done():
        return
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_: asyncio.Future[None]) -> None:
        if not ended.done():
            ended.set_result(None)

    watched = list(dict.fromkeys(session_ids))
    for session_id in watched:
        router.watchers.setdefault(session_id, []).append(ended)
    if asked is not None:
        asked.add_done_callback(wake)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended, max(0.0, deadline - time.monotonic()))
    finally:
        if asked is not None:
            asked.remove_done_callback(wake)
        for session_id in watched:
            waiters = router.watchers.get(session_id)
            if waiters is not None and ended in waiters:
                waiters.remove(ended)
                if not waiters:
                    del router.watchers[session_id]
