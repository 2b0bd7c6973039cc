"""What an app sees of gym-proxy on each request: its session and its worker."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gym_proxy.coordinator.contract import headers as names

__all__ = ["WorkerInfo", "WORKER_INFO", "WORKER_BACKLOG", "session_id", "session_token"]

# The accept queue of a worker's socket (the kernel caps it at net.core.somaxconn): a
# burst of new proxy connections must queue, not be refused with EAGAIN.
WORKER_BACKLOG = 4096

SESSION_ID_HEADER = names.text(names.SESSION_ID)
SESSION_TOKEN_HEADER = names.text(names.SESSION_TOKEN)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """This worker incarnation: its slot, its owner ID, its pid and its socket."""

    slot: int
    owner: str
    pid: int
    socket_path: str


WORKER_INFO = web.AppKey("gym_proxy_worker_info", WorkerInfo)


def session_id(request: web.Request) -> str | None:
    """The session ID the proxy assigned to this request (None if not behind the proxy)."""
    return request.headers.get(SESSION_ID_HEADER)


def session_token(request: web.Request) -> str | None:
    """The signed session token the client holds for this session."""
    return request.headers.get(SESSION_TOKEN_HEADER)
