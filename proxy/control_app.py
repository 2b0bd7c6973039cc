"""The control plane: an in-process aiohttp app the data path hands `/ng-control/` to.

It listens on a private Unix socket in the runtime directory; the front end forwards
control paths to it like to a worker, so the public port needs no second HTTP stack.
Without a control token every control path answers 404 (the server is not a
participant). With one, every call needs `Authorization: Bearer <token>` (compared in
constant time), bodies are checked strictly (unknown fields refused) and the coordinator
does the work.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from coordinator.checkpoint import Checkpointer
from coordinator.episode_ids import EpisodeId
from coordinator.phases import ControlError

__all__ = ["create_control_app", "PREFIX"]

PREFIX = "/ng-control/v1/checkpoint"
_BASE = {"checkpoint_id", "deadline_ts"}
# operation -> (required fields, optional fields)
_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    "prepare": (_BASE, set()),
    "renew": (_BASE, set()),
    "resume": (_BASE, set()),
    "commit": (_BASE | {"checkpoint_dir"}, {"episode_ids"}),
    "restore": (_BASE | {"checkpoint_dir", "episode_ids"}, set()),
    "retire": (_BASE | {"episode_ids"}, set()),
}
CHECKPOINTER = web.AppKey("gym_proxy_checkpointer", Checkpointer)


def _error(status: int, code: str, detail: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"code": code, "detail": detail}}),
        content_type="application/json",
        headers=headers,
    )


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _episode_ids(value: Any) -> list[EpisodeId]:
    if not isinstance(value, list):
        raise ControlError(400, "invalid_request", "episode_ids must be a list")
    result = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"rollout_id", "attempt"}:
            raise ControlError(
                400, "invalid_request", "each episode ID is {rollout_id, attempt}, nothing else"
            )
        rollout_id, attempt = item["rollout_id"], item["attempt"]
        if not isinstance(rollout_id, str) or not rollout_id:
            raise ControlError(400, "invalid_request", "rollout_id must be a non-empty string")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ControlError(400, "invalid_request", "attempt must be a non-negative integer")
        result.append(EpisodeId(rollout_id, attempt))
    return result


async def _body(request: web.Request, op: str) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ControlError(400, "invalid_request", f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ControlError(400, "invalid_request", "body must be a JSON object")
    required, optional = _FIELDS[op]
    unknown = set(body) - required - optional
    if unknown:
        raise ControlError(400, "invalid_request", f"unknown fields: {', '.join(sorted(unknown))}")
    missing = required - set(body)
    if missing:
        raise ControlError(400, "invalid_request", f"missing fields: {', '.join(sorted(missing))}")
    if not isinstance(body["checkpoint_id"], str):
        raise ControlError(400, "invalid_request", "checkpoint_id must be a string")
    deadline = body["deadline_ts"]
    if not isinstance(deadline, int | float) or isinstance(deadline, bool):
        raise ControlError(400, "invalid_request", "deadline_ts must be a number (Unix seconds)")
    if "checkpoint_dir" in body and (
        not isinstance(body["checkpoint_dir"], str) or not body["checkpoint_dir"]
    ):
        raise ControlError(400, "invalid_request", "checkpoint_dir must be a non-empty string")
    if body.get("episode_ids") is not None or "episode_ids" in required:
        body["episode_ids"] = _episode_ids(body.get("episode_ids"))
    return body


def _operation(op: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        cp = request.app[CHECKPOINTER]
        body = await _body(request, op)
        cid, deadline = body["checkpoint_id"], float(body["deadline_ts"])
        if op == "prepare":
            return _json(await cp.prepare(cid, deadline))
        if op == "renew":
            return _json(await cp.renew(cid, deadline))
        if op == "resume":
            return _json(await cp.resume(cid, deadline))
        if op == "commit":
            return _json(
                await cp.commit(cid, deadline, body["checkpoint_dir"], body.get("episode_ids"))
            )
        if op == "restore":
            return _json(
                await cp.restore(cid, deadline, body["checkpoint_dir"], body["episode_ids"])
            )
        return _json(await cp.retire(cid, deadline, body["episode_ids"]))

    return handler


async def _status(request: web.Request) -> web.Response:
    return _json(request.app[CHECKPOINTER].status())


def _guard(token: str | None) -> Any:
    expected = token.encode() if token else b""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if not expected:
            return _error(404, "not_found", "checkpoint control is not enabled on this server")
        given = request.headers.get("Authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credential.strip().encode(), expected
        ):
            return _error(401, "unauthorized", "a valid bearer token is required")
        try:
            return await handler(request)
        except ControlError as exc:
            return _error(exc.status, exc.code, exc.detail)
        except web.HTTPException as exc:
            return _error(
                exc.status, "not_found" if exc.status == 404 else "invalid_request", exc.reason
            )

    return guard


def create_control_app(checkpointer: Checkpointer, token: str | None) -> web.Application:
    """The control-plane app; `token` None means checkpoint control is off (404)."""
    # restore and retire bodies list episode IDs: allow large runs, not unbounded ones
    app = web.Application(middlewares=[_guard(token)], client_max_size=64 * 1024 * 1024)
    app[CHECKPOINTER] = checkpointer
    app.router.add_get(f"{PREFIX}/status", _status)
    for op in _FIELDS:
        app.router.add_post(f"{PREFIX}/{op}", _operation(op))
    return app
