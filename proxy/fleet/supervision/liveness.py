"""Liveness, as gunicorn and uvicorn judge it: every live worker is pinged over its
channel, and the worker's channel reader answers, so a pong means its event loop runs.

A worker silent for two ping intervals gets no new sessions (`WorkerRoute.responsive`);
one silent for `--worker-timeout` is killed by the supervisor (SIGKILL, which also ends
a SIGSTOPped process) and restarted, and its sessions answer 410. Silence counts from a
worker's first ping, not from its registering: it may have registered seconds before the
last worker did (a busy machine) and had nothing to answer since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gym_proxy.coordinator.contract.messages import Ping
from gym_proxy.proxy.fleet.supervision.worker_records import WorkerProcess

if TYPE_CHECKING:
    from gym_proxy.proxy.fleet.supervision.supervisor import Supervisor

__all__ = ["watch_liveness", "PING_INTERVAL"]

log = logging.getLogger("gym_proxy.supervisor")

PING_INTERVAL = 1.0


async def watch_liveness(supervisor: Supervisor) -> None:
    """Ping every live worker; stop placing on silent ones, have the ones that stay
    silent killed (module docstring). Runs until cancelled."""
    timeout = supervisor.config.worker_timeout
    interval = min(PING_INTERVAL, timeout / 4)
    while True:  # pings first: the workers' first pings go out as soon as it starts
        now = time.monotonic()
        for worker in supervisor.slots.workers():
            if worker.state != "live" or worker.channel is None or worker.route is None:
                continue
            if worker.ping is None:
                worker.answered_at = now
            if worker.ping is None or worker.ping.done():
                worker.ping = asyncio.ensure_future(_ping(worker, timeout))
            silent = now - worker.answered_at
            if silent > timeout:
                log.error(
                    "worker %d (pid %d) did not answer for %.1f s; killing it",
                    worker.slot,
                    worker.pid,
                    silent,
                )
                supervisor.kill(worker)
            elif silent > 2 * interval and worker.route.responsive:
                log.warning("worker %d is not answering; no new sessions go to it", worker.slot)
                worker.route.responsive = False
        await asyncio.sleep(interval)


async def _ping(worker: WorkerProcess, within: float) -> None:
    assert worker.channel is not None
    sent = time.monotonic()
    try:
        pong = await worker.channel.request(Ping(loop_lag=True), within=within)
    except (ConnectionError, TimeoutError):
        return  # a lost channel takes the worker out; silence is judged by the watch
    worker.answered_at = time.monotonic()
    worker.ping_seconds = worker.answered_at - sent
    worker.loop_lag_seconds = pong.loop_lag_seconds
    worker.reported_memory = pong.resident_bytes
    worker.reported_sessions = pong.sessions
    if worker.route is not None and not worker.route.responsive:
        log.info("worker %d answers again", worker.slot)
        worker.route.responsive = True
