"""`weather`: a resources server (FastAPI), NeMo Gym-shaped.

    gym-proxy gym_proxy.worker.apps.weather:create_app --workers 2

`POST /seed_session {}` starts a session; `POST /get_weather {city}` answers a
deterministic temperature and counts the call; `POST /verify {city, answer}` scores an
answer (1.0 when it names the right temperature after exactly one tool call) and ends
the session. State lives in the participant runtime's session store, so checkpoints
export and restore it. Tool calls may carry only `X-NeMo-Gym-Session-Token` (as MCP
clients do): the proxy routes them by it. `get_weather` names the worker that served it
(`served_by`). While the file `GYM_WEATHER_HOLD_FILE` names exists, `/verify` waits (to
test episodes that end during a checkpoint); `GET /held` counts the waiting calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from gym_proxy.worker.apps.hold import HoldSwitch
from gym_proxy.worker.apps.rollout_prefix import RolloutPrefix
from gym_proxy.worker.participant import Participation, context, current_session, declare

__all__ = ["create_app", "temperature"]


def temperature(city: str) -> int:
    """The (made-up, stable) temperature of `city` in degrees Celsius."""
    return int.from_bytes(hashlib.sha256(city.encode()).digest()[:2], "big") % 45 - 10


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    body = await request.json()
    return body if isinstance(body, dict) else {}


def create_app() -> Any:
    switch = HoldSwitch("GYM_WEATHER_HOLD_FILE")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(switch.watch())
        yield
        task.cancel()

    app = FastAPI(title="weather", lifespan=lifespan)

    @app.get("/held")
    async def held() -> dict[str, int]:
        return {"held": switch.waiting}

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        current_session(request).set({"calls": 0, "cities": []})
        return {"seeded": True}

    @app.post("/get_weather")
    async def get_weather(request: Request) -> dict[str, Any]:
        city = str((await _body(request)).get("city", ""))
        session = current_session(request)
        state = session.get() or {"calls": 0, "cities": []}
        state = {"calls": state["calls"] + 1, "cities": [*state["cities"], city]}
        session.set(state)
        served_by = context(request).worker.owner
        return {"city": city, "temperature_c": temperature(city), "served_by": served_by}

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, Any]:
        await switch.wait()
        body = await _body(request)
        state = current_session(request).get() or {"calls": 0, "cities": []}
        city, answer = str(body.get("city", "")), str(body.get("answer", ""))
        right = f"{temperature(city)} C" in answer and state["cities"] == [city]
        return {"reward": 1.0 if right else 0.0, "tool_calls": state["calls"]}

    return declare(RolloutPrefix(app), Participation(kind="resources"))
