"""The control plane: an in-process aiohttp app the data path hands `/ng-control/` to.

It listens on a private Unix socket in the runtime directory; the front end forwards
control paths to it like to a worker, so the public port needs no second HTTP stack.
Checkpoint routes come with the coordinator's checkpoint protocol; until a control token
is configured every control path answers 404, so the server is not a participant.
"""

from __future__ import annotations

import orjson
from aiohttp import web

__all__ = ["create_control_app"]


async def _not_participant(request: web.Request) -> web.Response:
    return web.Response(
        status=404,
        body=orjson.dumps(
            {
                "error": {
                    "code": "not_found",
                    "detail": "checkpoint control is not enabled on this server",
                }
            }
        ),
        content_type="application/json",
    )


def create_control_app() -> web.Application:
    """The control-plane app."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _not_participant)
    return app
