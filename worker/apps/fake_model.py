"""`fake_model`: a scripted policy behind `/v1/responses` (OpenAI Responses shape), aiohttp.

    gym-proxy gym_proxy.worker.apps.fake_model:create_app --workers 2

The policy: a conversation whose input holds no tool output yet is answered with a
`function_call` of `get_weather {city}` (the city is taken from the user's message, "...
in <city>?"); one that holds the tool's output is answered with a message naming the
temperature. A participant of kind `model`: while a checkpoint is open new calls get
`409 checkpoint_parked`, admitted calls finish and their answers wait until resume, and
none of them blocks the checkpoint (the caller repeats an undelivered call).

Knobs (environment): `GYM_FAKE_MODEL_LATENCY` seconds per call; the hold switch
`GYM_FAKE_MODEL_HOLD_FILE` + `GYM_FAKE_MODEL_HOLD_CALLS` (e.g. `2`): while that file
exists, a rollout's calls with those numbers (1 = its first call) wait, so rollouts are
in flight when a checkpoint comes; `GYM_FAKE_MODEL_HOLD_CITIES` (comma-separated) limits
it to rollouts asking about those cities. `GET /held` says how many calls are waiting here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from typing import Any

import orjson
from aiohttp import web

from gym_proxy.worker.apps.hold import HoldSwitch
from gym_proxy.worker.participant import Participation, declare

__all__ = ["create_app", "policy"]

_CITY = re.compile(r"in ([^?]+)\?")
_ids = itertools.count()


def _text_of(item: dict[str, Any]) -> str:
    content = item.get("content", "")
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if isinstance(part, dict))


def policy(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scripted answer to a conversation (Responses API input items)."""
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    if not outputs:
        asked = next((_text_of(i) for i in reversed(items) if i.get("role") == "user"), "")
        match = _CITY.search(asked)
        city = match.group(1) if match else "nowhere"
        return [
            {
                "type": "function_call",
                "call_id": f"call_{next(_ids)}",
                "name": "get_weather",
                "arguments": orjson.dumps({"city": city}).decode(),
            }
        ]
    result = orjson.loads(outputs[-1]["output"])
    text = f"The weather in {result['city']} is {result['temperature_c']} C."
    return [
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text}],
        }
    ]


SWITCH = web.AppKey("hold_switch", HoldSwitch)
_HOLD_CITIES = {c for c in os.environ.get("GYM_FAKE_MODEL_HOLD_CITIES", "").split(",") if c}


def _holds_city(items: list[dict[str, Any]]) -> bool:
    """Whether the hold switch applies to this conversation's city (all, by default)."""
    if not _HOLD_CITIES:
        return True
    asked = next((_text_of(i) for i in items if i.get("role") == "user"), "")
    match = _CITY.search(asked)
    return match is not None and match.group(1) in _HOLD_CITIES


async def responses(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read() or b"{}")
    items = body.get("input", [])
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    number = 1 + sum(1 for i in items if i.get("type") == "function_call_output")
    latency = float(os.environ.get("GYM_FAKE_MODEL_LATENCY", "0"))
    if latency:
        await asyncio.sleep(latency)
    if _holds_city(items):
        await request.app[SWITCH].wait(number)
    answer = {
        "id": f"resp_{next(_ids)}",
        "object": "response",
        "model": body.get("model", "fake-model"),
        "status": "completed",
        "output": policy(items),
    }
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def held(request: web.Request) -> web.Response:
    return web.json_response({"held": request.app[SWITCH].waiting})


def create_app() -> web.Application:
    app = web.Application()
    switch = app[SWITCH] = HoldSwitch("GYM_FAKE_MODEL_HOLD_FILE", "GYM_FAKE_MODEL_HOLD_CALLS")

    async def watch(app: web.Application) -> Any:
        task = asyncio.ensure_future(switch.watch())
        yield
        task.cancel()

    app.cleanup_ctx.append(watch)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/held", held)
    return declare(app, Participation(kind="model"))
