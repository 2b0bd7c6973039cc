"""The bench's skewed app (`bench/rebalance.py`): gym-proxy's counter, plus `/block`, a
handler that blocks its worker's event loop `?seconds=` (a synchronous call: a verifier
run inline, a blocking client), as the heavy sessions of NeMo Gym#3039 do; with `cpu=1`
it computes for that much CPU time instead of sleeping (a verifier's work, which also
takes a core from everything else on the machine)."""

from __future__ import annotations

import time

from aiohttp import web

from gym_proxy.worker.counter import create_app as create_counter_app


def hold_the_loop(seconds: float, cpu: bool) -> None:
    """Block the calling thread's loop `seconds`: asleep, or (`cpu`) computing until the
    thread has used that much CPU time."""
    if not cpu:
        time.sleep(seconds)
        return
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def block(request: web.Request) -> web.Response:
    seconds = float(request.query.get("seconds", "0.1"))
    hold_the_loop(seconds, request.query.get("cpu") == "1")
    return web.json_response({"blocked": seconds})


def create_app() -> web.Application:
    app = create_counter_app()
    app.router.add_post("/block", block)
    return app
