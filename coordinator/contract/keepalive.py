"""How long the proxy's pooled connections to a worker may idle, and the worker's side.

A pooled connection the worker has already closed fails the request sent on it, so the
proxy stops reusing a connection well before the worker would close it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["WORKER_KEEPALIVE", "POOL_IDLE"]

WORKER_KEEPALIVE: Final = 3600.0  # seconds a worker keeps an idle proxy connection open
POOL_IDLE: Final = 30.0  # seconds the proxy reuses an idle pooled connection

assert POOL_IDLE < WORKER_KEEPALIVE
