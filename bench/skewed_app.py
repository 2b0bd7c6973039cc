"""The bench's skewed app (`bench/rebalance.py`): gym-proxy's counter, plus `/block`, a
handler that blocks its worker's event loop `?seconds=` (a synchronous call: a verifier
run inline, a blocking client), as the heavy sessions of NeMo Gym#3039 do."""

from __future__ import annotations

import time

from aiohttp import web

from gym_proxy.worker.counter import create_app as create_counter_app


async def block(request: web.Request) -> web.Response:
    seconds = float(request.query.get("seconds", "0.1"))
    time.sleep(seconds)  # noqa: ASYNC251 -- blocking the loop is what it is for
    return web.json_response({"blocked": seconds})


def create_app() -> web.Application:
    app = create_counter_app()
    app.router.add_post("/block", block)
    return app
