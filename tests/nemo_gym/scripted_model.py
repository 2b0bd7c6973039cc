"""The policy model's backend in the NeMo Gym tier: an OpenAI Responses API endpoint
(`POST /v1/responses`, what NeMo Gym's `openai_model` calls) with a scripted policy. It
stands where an LLM would (none runs here); everything between it and the rollout
collection is NeMo Gym's own code.

The policy makes the reward depend on every resources call reaching the worker that
holds the session: for a prompt "add 3 then add 5 ... then get the count" it calls
`increment_counter` once per number, then `get_counter_value`, then answers with the
count it read. The counter's `/verify` compares the session's counter with the row's
`expected_count`, so one increment on a worker that does not hold the session (where the
counter starts at 0) makes the reward 0. For a structured-output prompt
(`tests/nemo_gym/structured.py`) it answers with the document the prompt asks for.

`POST /control/hold` makes the final turn of every rollout wait (the rollout is then in
flight, its resources session seeded and incremented), `POST /control/release` lets them
go, `GET /control/held` counts the waiting ones.

    python -m tests.nemo_gym.scripted_model PORT
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from tests.nemo_gym import structured

STATE = web.AppKey("state", dict)


def _response(output: list[dict[str, Any]]) -> web.Response:
    body = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": "scripted-policy",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "status": "completed",
        "usage": {
            "input_tokens": 1,
            "output_tokens": 1,
            "total_tokens": 2,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call_id = f"call_{uuid.uuid4().hex[:16]}"
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": orjson.dumps(arguments).decode(),
        "status": "completed",
    }


def _prompt(items: list[dict[str, Any]]) -> str:
    for item in items:
        if item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return " ".join(part.get("text", "") for part in content or ())
    raise web.HTTPBadRequest(text="no user message")


async def responses(request: web.Request) -> web.Response:
    body = await request.json()
    items = (
        body["input"]
        if isinstance(body["input"], list)
        else [{"role": "user", "content": body["input"]}]
    )
    text = _prompt(items)
    document = structured.answer(text)
    if document is not None:
        return _response([_message(document)])
    numbers = [int(n) for n in re.findall(r"add (\d+)", text)]
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    turn = len(outputs)
    if turn < len(numbers):
        return _response([_call("increment_counter", {"count": numbers[turn]})])
    if turn == len(numbers):
        return _response([_call("get_counter_value", {})])
    state = request.app[STATE]
    if state["hold"]:
        state["held"] += 1
        try:
            await state["released"].wait()
        finally:
            state["held"] -= 1
    count = orjson.loads(outputs[-1]["output"])["count"]
    return _response([_message(f"The count is {count}.")])


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:16]}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


async def hold(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state["hold"] = True
    state["released"] = asyncio.Event()
    return web.json_response({"hold": True})


async def release(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state["hold"] = False
    state["released"].set()
    return web.json_response({"hold": False})


async def held(request: web.Request) -> web.Response:
    return web.json_response({"held": request.app[STATE]["held"]})


def create_app() -> web.Application:
    app = web.Application()
    app[STATE] = {"hold": False, "held": 0, "released": asyncio.Event()}
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/control/hold", hold)
    app.router.add_post("/control/release", release)
    app.router.add_get("/control/held", held)
    return app


if __name__ == "__main__":
    web.run_app(create_app(), host="127.0.0.1", port=int(sys.argv[1]), print=None)
