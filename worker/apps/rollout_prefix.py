"""Strip `/ng-rollout/<key>/` for an ASGI app, as NeMo Gym's RolloutContextMiddleware does.

gym-proxy hands ASGI apps the path as the client sent it (NeMo Gym's servers strip the
prefix themselves); the reference FastAPI servers wrap their app in `RolloutPrefix` to
do the same. The participant runtime has already read the key from the path.
"""

from __future__ import annotations

from typing import Any

from gym_proxy.coordinator.contract.headers import ROLLOUT_PREFIX_TEXT, split_rollout_path

__all__ = ["RolloutPrefix"]


class RolloutPrefix:
    """Pure ASGI: the inner app sees `/rest` for `/ng-rollout/<key>/rest`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"].startswith(ROLLOUT_PREFIX_TEXT):
            _, path = split_rollout_path(scope["path"])
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)
