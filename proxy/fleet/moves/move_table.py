"""The router's side of the live operations: holds, placements and expected hand-overs.

A move holds a session's new requests at the proxy while it moves and releases them once
the session table points at the target; a decommission holds every request routed to a
worker while it takes it out; a hand-over tells the data path where the request a
worker gives back goes. Each is a change to the router's tables (`Router.holding`,
`WorkerRoute.held`, the session tables, `Router.handovers`) and, for a release, a
restart of the held exchanges (`proxy.data_path.exchange.start_held`). The mover, the
hand-overs and the decommissions change them here and nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gym_proxy.proxy.data_path.exchange import start_held, start_held_by_worker
from gym_proxy.proxy.data_path.routing import ExpectedHandover, Router, WorkerRoute
from gym_proxy.proxy.fleet.moves.session_watch import until_a_request_ends

__all__ = ["MoveTable"]


@dataclass(eq=False)
class MoveTable:
    router: Router
    # Told how long the released requests waited, in seconds (/metrics).
    on_held: Callable[[list[float]], None] | None = None

    def hold_sessions(self, session_ids: list[str]) -> None:
        """New requests of these sessions wait at the proxy until released."""
        for session_id in session_ids:
            self.router.holding.setdefault(session_id, [])

    def release_sessions(self, session_ids: list[str]) -> None:
        """The held requests go on, routed by the tables as they are now."""
        self._waited(start_held(self.router, session_ids))

    def hold_worker(self, route: WorkerRoute) -> None:
        """Requests routed to this worker wait at the proxy from now on."""
        if route.held is None:
            route.held = []

    def release_worker(self, route: WorkerRoute) -> None:
        """The requests held at this worker start again, routed by the tables as they are
        now."""
        self._waited(start_held_by_worker(route))

    def running_requests(self, session_id: str) -> int:
        return self.router.active.get(session_id, 0)

    async def until_a_request_ends(
        self, keys: Iterable[str], deadline: float, asked: asyncio.Future[None] | None = None
    ) -> None:
        """Until a request of one of `keys` (sessions, or a worker's `worker_watch` key)
        ends, `deadline` (time.monotonic()), or `asked` is done (the waiter gives way)."""
        await until_a_request_ends(self.router, keys, deadline, asked)

    def place_session(self, session_id: str, owner: str, kept: bool) -> None:
        """The session table sends `session_id` to `owner`: a session ID as the workers
        keep it (`kept`: a record's), or a gym-proxy session that rides along with one
        (`proxy.data_path.routing`, "Identity")."""
        table = self.router.kept if kept else self.router.sessions
        table[session_id] = owner

    def expect_handover(self, handover_id: str, source: str, target: str) -> asyncio.Future[str]:
        """The data path is to send the request `source` gives back under `handover_id`
        on to `target`; the future says how that went ("" once sent on, else why not)."""
        arrived: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        routes = self.router.workers
        if source not in routes or target not in routes:
            arrived.set_result("the source or the target worker is gone")
        else:
            handover = ExpectedHandover(routes[source], routes[target], arrived)
            self.router.handovers[handover_id.encode()] = handover
        return arrived

    def forget_handover(self, handover_id: str) -> None:
        self.router.handovers.pop(handover_id.encode(), None)

    def _waited(self, waits: list[float]) -> None:
        if waits and self.on_held is not None:
            self.on_held(waits)
