"""`counter`: the reference resources server with per-session state.

Routes (POST with a JSON body, as NeMo Gym resources servers take them):
`/seed_session {initial_count}`, `/increment_counter {count}`, `/get_counter_value`,
`/verify {expected_count}` -> `{reward}`. Counters live in the participant runtime's
session store, so a checkpoint exports them and a restore brings them back.

`/compute {seconds}` computes for that long (at most MAX_COMPUTE) without yielding, as a
CPU-bound tool call or verifier does: the worker's event loop is blocked meanwhile, so
`--rebalance` can be seen at work with the default app (docs/operations.md, Rebalancing).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gym_proxy.worker.participant import PARTICIPANT_KIND, current_session

__all__ = ["create_app", "MAX_COMPUTE"]

MAX_COMPUTE = 10.0  # seconds one /compute may block its worker


def _json(payload: Any) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _bad_request(code: str, detail: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        body=orjson.dumps({"error": {"code": code, "detail": detail}}),
        content_type="application/json",
    )


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad_request("invalid_json", str(exc)) from exc
    if not isinstance(body, dict):
        raise _bad_request("invalid_json", "expected a JSON object")
    return body


def _integer(body: dict[str, Any], name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad_request("invalid_field", f"{name} must be an integer")
    return value


async def seed_session(request: web.Request) -> web.Response:
    body = await _body(request)
    count = _integer(body, "initial_count", 0)
    current_session(request).set(count)
    return _json({"count": count})


async def increment_counter(request: web.Request) -> web.Response:
    body = await _body(request)
    session = current_session(request)
    count = session.get(0) + _integer(body, "count", 1)
    session.set(count)
    return _json({"count": count})


async def get_counter_value(request: web.Request) -> web.Response:
    return _json({"count": current_session(request).get(0)})


async def verify(request: web.Request) -> web.Response:
    body = await _body(request)
    expected = _integer(body, "expected_count")
    actual = current_session(request).get(0)
    return _json({"reward": 1.0 if actual == expected else 0.0, "count": actual})


async def compute(request: web.Request) -> web.Response:
    body = await _body(request)
    seconds = body.get("seconds", 1.0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise _bad_request("invalid_field", "seconds must be a number")
    if not 0 <= seconds <= MAX_COMPUTE:
        raise _bad_request("invalid_field", f"seconds must be 0-{MAX_COMPUTE:g}")
    until = time.monotonic() + seconds
    while time.monotonic() < until:  # never awaits: the loop is blocked, as by real work
        pass
    return _json({"count": current_session(request).get(0), "computed_s": seconds})


def create_app() -> web.Application:
    """The counter server's app."""
    app = web.Application()
    app[PARTICIPANT_KIND] = "resources"
    app.router.add_post("/seed_session", seed_session)
    app.router.add_post("/increment_counter", increment_counter)
    app.router.add_route("*", "/get_counter_value", get_counter_value)
    app.router.add_post("/verify", verify)
    app.router.add_post("/compute", compute)
    return app
