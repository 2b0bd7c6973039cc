"""The header names and path prefix the proxy and the workers speak between them.

The proxy sets the identity headers on every request it routes and strips any a client
sent; the workers read them. A worker's runtime announces an app session it holds in a
response header the proxy strips before the client sees it. Names are lower case bytes,
as the data path compares them; `text()` gives the str a worker's framework uses.

`/ng-rollout/<key>/rest` names a request's rollout in its path: the key ends at the next
`/` (or `?`), and the app sees `/rest`. An empty key is `bad_request` on either floor.
"""

from __future__ import annotations

from typing import Final

from gym_proxy.coordinator.contract.errors import GymError

__all__ = [
    "SESSION_ID",
    "SESSION_TOKEN",
    "SESSION_NEW",
    "EPISODE_KEY",
    "APP_SESSION_CLAIM",
    "SESSION_OWNER",
    "APP_TOKEN",
    "APP_SESSION",
    "APP_SESSION_END",
    "HANDOVER_HEADER",
    "HANDOVER_STATUS",
    "IDENTITY_HEADERS",
    "CONTROL_PREFIX",
    "CHECKPOINT_PATH",
    "MOVE_PATH",
    "WORKERS_PATH",
    "ROLLOUT_PREFIX",
    "ROLLOUT_PREFIX_TEXT",
    "EMPTY_ROLLOUT_KEY",
    "text",
    "split_rollout_url",
    "split_rollout_path",
]

# Set by the proxy on the requests it routes (a client's own are stripped).
SESSION_ID: Final = b"x-ng-session-id"  # the request's gym-proxy session
SESSION_TOKEN: Final = b"x-ng-session-token"  # that session's signed token
SESSION_NEW: Final = b"x-ng-session-new"  # "1": the proxy minted the session for it
EPISODE_KEY: Final = b"x-ng-episode-key"  # the /ng-rollout/<key>/ an aiohttp app lost
# The app session a request's own token or cookie names, when the proxy routed it by that
# (unverified: the app checks its own token; it is never a gym-proxy session).
APP_SESSION_CLAIM: Final = b"x-ng-app-session-claim"
IDENTITY_HEADERS: Final = frozenset(
    {SESSION_ID, SESSION_TOKEN, SESSION_NEW, EPISODE_KEY, APP_SESSION_CLAIM}
)
# Sent by clients: a new session on this owner's worker (an agent's own calls).
SESSION_OWNER: Final = b"x-ng-session-owner"
# NeMo Gym's session token header: gym-proxy's tokens and an app's own MCP tokens.
APP_TOKEN: Final = b"x-nemo-gym-session-token"
# Sent by a worker's runtime, stripped by the proxy: an app session it now holds, or ended.
APP_SESSION: Final = b"x-ng-app-session"
APP_SESSION_END: Final = b"x-ng-app-session-end"
# A worker's answer to a request whose episode it handed over: the status, this header
# (the hand-over id a move gave it) and, as the body, the request's body. The proxy sends
# the request on to the target and the client never sees this answer; should it ever be
# relayed (no move asked for it), 503 tells the client it was not served.
HANDOVER_HEADER: Final = b"x-ng-handover"
HANDOVER_STATUS: Final = 503

# The control plane: NeMo Gym's Gen-2 checkpoint calls, and gym-proxy's own operations
# (a path that cannot collide with NeMo Gym's). The proxy answers these itself.
CONTROL_PREFIX: Final = b"/ng-control/"
CHECKPOINT_PATH: Final = "/ng-control/v1/checkpoint"
MOVE_PATH: Final = "/ng-control/v1/gym-proxy/sessions/move"
# + /drain, /undrain, /restart, /resize: live operations on the workers
WORKERS_PATH: Final = "/ng-control/v1/gym-proxy/workers"

ROLLOUT_PREFIX: Final = b"/ng-rollout/"
ROLLOUT_PREFIX_TEXT: Final = "/ng-rollout/"
EMPTY_ROLLOUT_KEY: Final = ("bad_request", "/ng-rollout/ needs an episode key")


def text(name: bytes) -> str:
    """A header name as the str a worker's framework uses."""
    return name.decode("ascii")


def split_rollout_url(url: bytes, start: int = len(ROLLOUT_PREFIX)) -> tuple[bytes, bytes]:
    """`/ng-rollout/<key>/rest?q` -> (key, `/rest?q`); the key ends at `/` or `?`, and may
    be empty (the caller refuses that as EMPTY_ROLLOUT_KEY)."""
    end = len(url)
    for stop in (b"/", b"?"):
        at = url.find(stop, start)
        if 0 <= at < end:
            end = at
    rest = url[end:]
    if not rest.startswith(b"/"):
        rest = b"/" + rest
    return url[start:end], rest


def split_rollout_path(path: str) -> tuple[str | None, str]:
    """`/ng-rollout/<key>/rest` -> (key, `/rest`); any other path -> (None, path). An
    empty key raises GymError(EMPTY_ROLLOUT_KEY)."""
    if not path.startswith(ROLLOUT_PREFIX_TEXT):
        return None, path
    key, slash, rest = path[len(ROLLOUT_PREFIX_TEXT) :].partition("/")
    if not key:
        raise GymError(*EMPTY_ROLLOUT_KEY)
    return key, "/" + rest if slash else "/"
