"""`simple_agent`: an agent server (aiohttp) with native sessions and a legacy `/run`.

    gym-proxy gym_proxy.worker.apps.simple_agent:create_app --workers 2

Native sessions: `POST /seed_session {weather_token}` opens one; `POST /v1/responses
{input, turn_id}` runs a turn: model call -> tool calls -> model call ... until the model
answers without a tool call. The turn keeps its progress in the session (items, model
and tool call counts), so a checkpoint exports it with the session; a turn sent again
with the same `turn_id` after a restore continues where the session stands (or returns
the finished answer). Boundaries: before each model call and after each tool round; the
model call is a `replay` step (while it is out, the turn counts as parked).

Legacy `POST /run {city, instructions?, _ng_rollout_id, _ng_attempt_index}`: one episode
that seeds a weather session, opens a native session on this same worker (by calling its own server
with `x-ng-session-owner`), runs one turn there, verifies and closes, with boundaries
between the steps.

Other servers: `GYM_REF_MODEL_URL`, `GYM_REF_WEATHER_URL`, and its own public URL
`GYM_REF_AGENT_URL`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gym_proxy.worker.apps.calls import call, server_url
from gym_proxy.worker.apps.episode_steps import weather_episode
from gym_proxy.worker.participant import Participation, context, declare, episode

__all__ = ["create_app", "run_turn"]


def _json(payload: Any) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    body = orjson.loads(raw) if raw else {}
    return body if isinstance(body, dict) else {}


def _prefix(request: web.Request) -> str:
    """`/ng-rollout/<key>` when the request carries rollout identity, else ``."""
    flight = context(request).flight
    return f"/ng-rollout/{flight.identity.key}" if flight.identity is not None else ""


async def seed_session(request: web.Request) -> web.Response:
    body = await _body(request)
    state: dict[str, Any] = {"weather_token": body.get("weather_token"), "items": [], "turn": None,
             "done": {}, "model_calls": 0, "tool_calls": 0}  # fmt: skip
    context(request).session.set(state)
    return _json({"seeded": True})


async def run_turn(request: web.Request, state: dict[str, Any], turn_id: str, user: Any) -> Any:
    """One turn of the loop; `state` is the session's, saved after every step."""
    ctx = context(request)
    session = ctx.session
    ep = ctx.flight.episode
    prefix = _prefix(request)
    if state["turn"] != turn_id:
        items = [{"role": "user", "content": user}] if isinstance(user, str) else list(user)
        state.update(turn=turn_id, items=state["items"] + items)
        session.set(state)
    while True:
        if ep is not None:
            await ep.boundary({"turn": turn_id, "items": len(state["items"])})
        model_call = call(f"{server_url('model')}{prefix}/v1/responses", {"input": state["items"]})
        reply = (await ep.replay(model_call)) if ep is not None else await model_call
        outputs = reply.body["output"]
        state.update(items=state["items"] + outputs, model_calls=state["model_calls"] + 1)
        session.set(state)
        tool_calls = [o for o in outputs if o.get("type") == "function_call"]
        if not tool_calls:
            answer = {"id": reply.body["id"], "object": "response", "output": outputs,
                      "output_text": _output_text(outputs),
                      "usage": {"model_calls": state["model_calls"],
                                "tool_calls": state["tool_calls"]}}  # fmt: skip
            state["done"] = {**state["done"], turn_id: answer}
            session.set(state)
            return answer
        for tool_call in tool_calls:
            result = await call(
                f"{server_url('weather')}{prefix}/{tool_call['name']}",
                orjson.loads(tool_call["arguments"]),
                token=state["weather_token"],  # all an MCP-style call carries
            )
            output = {"type": "function_call_output", "call_id": tool_call["call_id"],
                      "output": orjson.dumps(result.body).decode()}  # fmt: skip
            state.update(items=[*state["items"], output], tool_calls=state["tool_calls"] + 1)
            session.set(state)
        if ep is not None:
            await ep.boundary({"turn": turn_id, "items": len(state["items"])})


def _output_text(outputs: list[dict[str, Any]]) -> str:
    return " ".join(
        part.get("text", "")
        for o in outputs
        if o.get("type") == "message"
        for part in o.get("content", [])
    )


async def responses(request: web.Request) -> web.Response:
    body = await _body(request)
    session = context(request).session
    state = session.get()
    if state is None:
        raise web.HTTPConflict(
            body=orjson.dumps({"error": {"code": "no_session", "detail": "seed a session first"}}),
            content_type="application/json",
        )
    turn_id = str(body.get("turn_id", "turn"))
    if turn_id in state["done"]:
        return _json(state["done"][turn_id])  # a turn sent again after it finished
    return _json(await run_turn(request, state, turn_id, body.get("input", "")))


async def close_session(request: web.Request) -> web.Response:
    return _json({"closed": True})  # the runtime drops the session on this 2xx


async def run(request: web.Request) -> web.Response:
    """The legacy episode; its turn runs on this worker (`x-ng-session-owner`)."""
    body = await _body(request)
    owner = context(request).worker.owner
    reply = await weather_episode(episode(request), body, "agent", owner)
    return _json(reply)


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/seed_session", seed_session)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/close_session", close_session)
    app.router.add_post("/run", run)
    return declare(app, Participation(kind="agent"))
