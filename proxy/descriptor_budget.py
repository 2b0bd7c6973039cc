"""How the proxy's descriptors are shared out, so that no listener takes what another needs.

The data path gets 2 descriptors per client connection (the client's, and while a
request is in flight one to a worker), `--max-connections` of them. Everything else is
bounded on its own and reserved ahead, whatever its clients do:

    BASE_RESERVE          the interpreter, the event loop, the log, the listening
                          sockets, files read now and then (/proc, checkpoints)
    the --metrics port    METRICS_CONNECTIONS (proxy.metrics.listener), when it is on
    the control app       2 per CONTROL_CONNECTIONS: the pool's end and the app's end of
                          each connection are both in this process
    each worker           PER_WORKER: its channel, its process, a spare (a rolling restart
                          runs a slot's successor beside it)
    coordinator socket    CHANNEL_MARGIN connections beyond the workers' channels
                          (coordinator.worker_channels closes the rest)

Workers added later (TTIN, resize) are paid for from BASE_RESERVE's slack.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from typing import Final

__all__ = [
    "BASE_RESERVE",
    "CHANNEL_MARGIN",
    "CONTROL_CONNECTIONS",
    "METRICS_CONNECTIONS",
    "PER_WORKER",
    "connection_cap",
    "reserve",
]

log = logging.getLogger("gym_proxy")

BASE_RESERVE: Final = 64
METRICS_CONNECTIONS: Final = 16  # Prometheus scrapes a target over one connection
CONTROL_CONNECTIONS: Final = 8  # controllers make a few calls at a time
PER_WORKER: Final = 3
CHANNEL_MARGIN: Final = 4
DEFAULT_MAX_CONNECTIONS: Final = 10000


def reserve(workers: int, metrics: bool) -> int:
    """Descriptors kept out of the data path's reach for `workers` workers."""
    listeners = (METRICS_CONNECTIONS if metrics else 0) + 2 * CONTROL_CONNECTIONS
    return BASE_RESERVE + listeners + PER_WORKER * workers + CHANNEL_MARGIN


def connection_cap(asked: int | None, reserved: int) -> int:
    """Raise the soft descriptor limit toward what the cap needs (2 a connection, plus
    `reserved`) and return the cap. Without `--max-connections` the cap is
    DEFAULT_MAX_CONNECTIONS or what the limit allows; an explicit cap is kept, with a
    warning when the limit is too low (as HAProxy does)."""
    wanted = asked or DEFAULT_MAX_CONNECTIONS
    needed = 2 * wanted + reserved
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft >= needed:
        return wanted
    if asked is None:
        return max(1, (soft - reserved) // 2)
    log.warning(
        "the descriptor limit (%d) is below the %d that --max-connections %d can need; "
        "raise it (ulimit -n) or lower --max-connections",
        soft,
        needed,
        wanted,
    )
    return wanted
