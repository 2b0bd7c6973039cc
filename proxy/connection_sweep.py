"""The data path's coarse clock and the timeouts it keeps: once a second, advance
`ProxyState.now` and end what waited too long (a slow request head, an idle keep-alive
client, a refused client still sending, an idle tunnel, a worker that stopped answering
mid-response) and close pooled worker connections idle past their keep-alive.

One sweep of every connection a second costs less than a timer per connection, and the
data path reads the clock from `ProxyState.now` instead of asking the loop per request.
The sweep never awaits anything but its own timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from gym_proxy.coordinator.contract.keepalive import POOL_IDLE
from gym_proxy.proxy.data_path.client_connection import (
    DISCARDING,
    LINGERING,
    TUNNEL,
    ProxyState,
)
from gym_proxy.proxy.data_path.routing import WorkerRoute

__all__ = ["sweep_connections", "SWEEP_INTERVAL", "LINGER"]

SWEEP_INTERVAL = 1.0
LINGER = 2.0  # a refused client gets this long (since its last byte) to stop sending


async def sweep_connections(state: ProxyState, routes: Callable[[], Iterable[WorkerRoute]]) -> None:
    """Sweep every SWEEP_INTERVAL seconds until cancelled; `routes` are the workers'
    routes whose pools are swept (the control app's too)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        state.now = loop.time()
        _expire_clients(state)
        pool_before = state.now - POOL_IDLE
        for route in routes():
            route.pool.close_idle(pool_before)


def _expire_clients(state: ProxyState) -> None:
    now = state.now
    idle_before = now - state.keepalive_timeout
    head_before = now - state.header_timeout if state.header_timeout else None
    discard_before = now - (state.header_timeout or state.keepalive_timeout)
    stall_before = now - state.upstream_timeout if state.upstream_timeout else None
    linger_before = now - LINGER
    tunnel_before = now - state.tunnel_idle_timeout
    for client in list(state.clients):
        phase = client.phase
        if phase == LINGERING:
            if client.last_active < linger_before:
                client.abort()
            continue
        if phase == TUNNEL:
            if client.last_active < tunnel_before:
                client.tunnel_timed_out()
            continue
        since = client.head_since
        if head_before is not None and since is not None and since < head_before:
            if not client.read_pause:
                client.head_timed_out()
                continue
        pipeline = client.pipeline
        if not pipeline:
            if client.parsing is None:
                if client.last_active < idle_before:
                    client.close()
            elif phase == DISCARDING and client.last_active < discard_before:
                client.abort()  # a client that stopped sending the body we drop
            continue
        heard = pipeline[0].upstream_idle_since()
        if stall_before is not None and heard is not None and heard < stall_before:
            pipeline[0].timed_out()
