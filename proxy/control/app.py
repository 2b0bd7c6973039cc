"""The control plane: an in-process aiohttp app the data path hands `/ng-control/` to.

It listens on a private Unix socket in the runtime directory; the front end forwards
control paths to it like to a worker, so the public port needs no second HTTP stack.
Without a control token every control path answers 404 (the server is not a
participant). With one, every call needs `Authorization: Bearer <token>` (compared in
constant time), bodies are checked strictly (unknown fields refused) and the coordinator
does the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gym_proxy.coordinator.checkpointer import Checkpointer
from gym_proxy.coordinator.contract import telemetry
from gym_proxy.coordinator.contract.answers import CommitAnswer, PrepareAnswer, ServerStatus
from gym_proxy.coordinator.contract.episodes import EpisodeId, check_rollout_ids
from gym_proxy.coordinator.contract.errors import GymError, error_body, status_of
from gym_proxy.coordinator.contract.headers import CHECKPOINT_PATH, MOVE_PATH, WORKERS_PATH
from gym_proxy.coordinator.contract.ids import is_valid_id
from gym_proxy.coordinator.contract.messages import Message
from gym_proxy.coordinator.contract.telemetry import ATTRIBUTE
from gym_proxy.proxy.config import MAX_WORKERS
from gym_proxy.proxy.fleet.balance.balancer import Balancer
from gym_proxy.proxy.fleet.moves.mover import Mover
from gym_proxy.proxy.fleet.operations.live import RESTART_PAUSE, Operations

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware

__all__ = ["create_control_app", "PREFIX"]

PREFIX = CHECKPOINT_PATH
_BASE = {"checkpoint_id", "deadline_ts"}
# operation -> (required fields, optional fields)
_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    "prepare": (_BASE, set()),
    "renew": (_BASE, set()),
    "resume": (_BASE, set()),
    "commit": (_BASE | {"checkpoint_dir"}, {"episode_ids", "stop"}),
    "restore": (_BASE | {"checkpoint_dir", "episode_ids"}, set()),
    "retire": (_BASE | {"episode_ids"}, set()),
    "forget": (_BASE | {"rollout_ids"}, set()),
}
CHECKPOINTER = web.AppKey("gym_proxy_checkpointer", Checkpointer)
MOVER = web.AppKey("gym_proxy_mover", Mover)
OPERATIONS = web.AppKey("gym_proxy_operations", Operations)
BALANCER = web.AppKey("gym_proxy_balancer", Balancer)
# Told each checkpoint call's operation, outcome (ok or the error code) and seconds.
OBSERVE = web.AppKey[Callable[[str, str, float], None]]("gym_proxy_observe")
# Controllers give deadlines of minutes; a day ahead is a bug, and would hold the lease
# open (and admission closed) for as long.
MAX_DEADLINE_AHEAD = 86400.0
log = logging.getLogger("gym_proxy.control")


def _error(code: str, detail: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if code == "unauthorized" else None
    return web.Response(
        status=status_of(code),
        body=error_body(code, detail),
        content_type="application/json",
        headers=headers,
    )


def _json(answer: Message) -> web.Response:
    return web.Response(body=orjson.dumps(answer.as_json()), content_type="application/json")


_EPISODE_FIELDS = {"rollout_id", "attempt"}


def _episode_ids(value: Any, at_least: int) -> list[EpisodeId]:
    if not isinstance(value, list) or len(value) < at_least:
        raise GymError("invalid_request", f"episode_ids must be a list of {at_least} or more")
    # A restore names every episode in flight (thousands): checks cheap per item, the
    # rollout IDs all in one pass.
    for item in value:
        if type(item) is not dict or item.keys() != _EPISODE_FIELDS:
            raise GymError(
                "invalid_request", "each episode ID is {rollout_id, attempt}, nothing else"
            )
        attempt = item["attempt"]
        if type(attempt) is not int or attempt < 0:  # a bool's type is bool, not int
            raise GymError("invalid_request", "attempt must be a non-negative integer")
    rollout_ids = check_rollout_ids([item["rollout_id"] for item in value])
    return [EpisodeId(r, item["attempt"]) for r, item in zip(rollout_ids, value, strict=True)]


async def _json_object(request: web.Request, fields: set[str]) -> dict[str, Any]:
    """The body as a JSON object holding no field outside `fields`, or GymError."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise GymError("invalid_request", f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise GymError("invalid_request", "body must be a JSON object")
    unknown = set(body) - fields
    if unknown:
        raise GymError("invalid_request", f"unknown fields: {', '.join(sorted(unknown))}")
    return body


async def _body(request: web.Request, op: str) -> dict[str, Any]:
    required, optional = _FIELDS[op]
    body = await _json_object(request, required | optional)
    missing = required - set(body)
    if missing:
        raise GymError("invalid_request", f"missing fields: {', '.join(sorted(missing))}")
    if not isinstance(body["checkpoint_id"], str):
        raise GymError("invalid_request", "checkpoint_id must be a string")
    deadline = body["deadline_ts"]
    if not isinstance(deadline, int | float) or isinstance(deadline, bool):
        raise GymError("invalid_request", "deadline_ts must be a number (Unix seconds)")
    if not deadline <= time.time() + MAX_DEADLINE_AHEAD:
        raise GymError(
            "invalid_request",
            f"deadline_ts is more than {MAX_DEADLINE_AHEAD:.0f} s ahead (or not a number)",
        )
    directory = body.get("checkpoint_dir")
    if "checkpoint_dir" in body and (
        not isinstance(directory, str) or not directory or "\0" in directory
    ):
        raise GymError("invalid_request", "checkpoint_dir must be a non-empty path string")
    if body.get("episode_ids") is not None or "episode_ids" in required:
        body["episode_ids"] = _episode_ids(body.get("episode_ids"), 1 if op == "retire" else 0)
    if "rollout_ids" in body:
        ids = body["rollout_ids"]
        if not isinstance(ids, list) or not ids:
            raise GymError("invalid_request", "rollout_ids must be a list of 1 or more")
        body["rollout_ids"] = check_rollout_ids(ids)
    if not isinstance(body.get("stop", False), bool):
        raise GymError("invalid_request", "stop must be true or false")
    return body


def _operation(op: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        observe = request.app.get(OBSERVE)
        started = time.monotonic()
        outcome = "internal_error"
        cp = request.app[CHECKPOINTER]
        base = {
            ATTRIBUTE + "participant_kind": cp.kind or "resources",
            ATTRIBUTE + "instance": cp.instance,
        }
        # NeMo Gym names renew no span; the controller's traceparent is the parent.
        traced = (
            telemetry.span(f"gym.checkpoint.{op}", base, request.headers.get("traceparent"))
            if op != "renew"
            else contextlib.nullcontext()
        )
        read_before = cp.io.records_read
        try:
            with traced as current:
                response, reply = await _call(request, current)
                if current is not None:
                    current.set_attributes(_reply_attributes(reply))
                    if op == "restore":
                        records = cp.io.records_read - read_before
                        current.set_attribute(ATTRIBUTE + "records", records)
            outcome = "ok"
            return response
        except GymError as exc:
            outcome = exc.code
            raise
        finally:
            if observe is not None:
                observe(op, outcome, time.monotonic() - started)

    async def _call(request: web.Request, current: Any) -> tuple[web.Response, Message]:
        cp = request.app[CHECKPOINTER]
        body = await _body(request, op)
        cid, deadline = body["checkpoint_id"], float(body["deadline_ts"])
        if current is not None:
            current.set_attribute(ATTRIBUTE + "id", cid)
            if "episode_ids" in body and op == "retire":
                current.set_attribute(ATTRIBUTE + "episodes", len(body["episode_ids"]))
            if op == "forget":
                current.set_attribute(ATTRIBUTE + "rollouts", len(body["rollout_ids"]))
        reply = await _run(cp, op, cid, deadline, body)
        return _json(reply), reply

    return handler


async def _run(
    cp: Checkpointer, op: str, cid: str, deadline: float, body: dict[str, Any]
) -> Message:
    """The checkpointer's answer to one control call."""
    if op == "prepare":
        return await cp.prepare(cid, deadline)
    if op == "renew":
        return await cp.renew(cid, deadline)
    if op == "resume":
        return await cp.resume(cid, deadline)
    if op == "commit":
        return await cp.commit(
            cid, deadline, body["checkpoint_dir"], body.get("episode_ids"), body.get("stop", False)
        )
    if op == "restore":
        return await cp.restore(cid, deadline, body["checkpoint_dir"], body["episode_ids"])
    if op == "forget":
        return await cp.forget(cid, deadline, body["rollout_ids"])
    return await cp.retire(cid, deadline, body["episode_ids"])


def _reply_attributes(reply: Message) -> dict[str, str | int]:
    """NeMo Gym's attributes that come from the answer: phase, blockers (prepare) and
    records (commit)."""
    attributes: dict[str, str | int] = {}
    phase = getattr(reply, "phase", "")
    if phase:
        attributes[ATTRIBUTE + "phase"] = phase
    if isinstance(reply, PrepareAnswer):
        attributes[ATTRIBUTE + "blockers"] = reply.report.blocker_count
    if isinstance(reply, CommitAnswer):
        attributes[ATTRIBUTE + "records"] = reply.manifest.record_count
    return attributes


MAX_OPERATION_TIMEOUT = 3600.0


def _timeout(body: dict[str, Any], default: float) -> float:
    timeout = body.get("timeout_s", default)
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 < timeout <= MAX_OPERATION_TIMEOUT
    ):
        raise GymError("invalid_request", "timeout_s must be a number of seconds, 0-3600")
    return float(timeout)


def _slot(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise GymError("invalid_request", f"{name} must be a worker slot (an integer)")
    return value


async def _move(request: web.Request) -> web.Response:
    """Move live sessions to the worker in one slot (`proxy.fleet.moves.mover`)."""
    body = await _json_object(request, {"session_ids", "to_slot", "timeout_s"})
    ids = body.get("session_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, str) and is_valid_id(i) for i in ids)
    ):
        raise GymError("invalid_request", "session_ids must be a non-empty list of session IDs")
    slot = _slot(body.get("to_slot"), "to_slot")
    timeout = _timeout(body, 30.0)
    return _json(await request.app[MOVER].move(ids, slot, within=timeout))


async def _drain(request: web.Request) -> web.Response:
    body = await _json_object(request, {"slot", "timeout_s"})
    slot = _slot(body.get("slot"), "slot")
    return _json(await request.app[OPERATIONS].drain(slot, _timeout(body, 60.0)))


async def _undrain(request: web.Request) -> web.Response:
    body = await _json_object(request, {"slot"})
    return _json(await request.app[OPERATIONS].undrain(_slot(body.get("slot"), "slot")))


async def _restart(request: web.Request) -> web.Response:
    body = await _json_object(request, {"slots", "timeout_s", "pause_s"})
    slots = body.get("slots")
    if slots is not None:
        if not isinstance(slots, list) or not slots:
            raise GymError("invalid_request", "slots must be a non-empty list of worker slots")
        slots = list(dict.fromkeys(_slot(s, "each of slots") for s in slots))
    pause = body.get("pause_s", RESTART_PAUSE)
    if not isinstance(pause, int | float) or isinstance(pause, bool) or not 0 <= pause <= 600:
        raise GymError("invalid_request", "pause_s must be a number of seconds, 0-600")
    operations = request.app[OPERATIONS]
    reply = await operations.restart(slots, _timeout(body, 60.0), pause=float(pause))
    return _json(reply)


async def _resize(request: web.Request) -> web.Response:
    body = await _json_object(request, {"workers", "timeout_s"})
    workers = body.get("workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise GymError("invalid_request", f"workers must be an integer, 1-{MAX_WORKERS}")
    return _json(await request.app[OPERATIONS].resize(workers, _timeout(body, 60.0)))


async def _status(request: web.Request) -> web.Response:
    return _json(server_status(request.app))


def server_status(app: web.Application) -> ServerStatus:
    """The checkpointer's status with the fleet's: each worker's state, count and load
    (one list of the registered workers), the moves, the operations and the rebalances."""
    status = app[CHECKPOINTER].status()
    mover, operations, balancer = app.get(MOVER), app.get(OPERATIONS), app.get(BALANCER)
    workers = [
        dataclasses.replace(
            operations.describe(worker) if operations is not None else worker,
            load=balancer.load_of(worker.owner) if balancer is not None else None,
        )
        for worker in status.workers
    ]
    return dataclasses.replace(
        status,
        workers=workers,
        moving_sessions=mover.holding if mover is not None else 0,
        operations=operations.status() if operations is not None else None,
        rebalance=balancer.status() if balancer is not None else None,
        autoscale=(
            balancer.autoscaler.status()
            if balancer is not None and balancer.autoscaler is not None
            else None
        ),
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _guard(token: str | None) -> Middleware:
    expected = token.encode() if token else b""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not expected:
            return _error("not_found", "checkpoint control is not enabled on this server")
        given = request.headers.get("Authorization", "")
        scheme, _, credential = given.partition(" ")
        # Header values may hold any byte (surrogate-escaped); they compare, never crash.
        offered = credential.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(offered, expected):
            return _error("unauthorized", "a valid bearer token is required")
        try:
            return await handler(request)
        except GymError as exc:
            return _error(exc.code, exc.detail)
        except web.HTTPException as exc:
            return _error(_HTTP_CODES.get(exc.status, "invalid_request"), exc.reason)
        except Exception:
            log.exception("control call %s %s failed", request.method, request.path)
            return _error("internal_error", "the control call failed; see the gym-proxy log")

    return guard


def create_control_app(
    checkpointer: Checkpointer,
    token: str | None,
    mover: Mover | None = None,
    operations: Operations | None = None,
    observe: Callable[[str, str, float], None] | None = None,
    balancer: Balancer | None = None,
) -> web.Application:
    """The control-plane app; `token` None means checkpoint control is off (404)."""
    # restore and retire bodies list episode IDs: allow large runs, not unbounded ones
    app = web.Application(middlewares=[_guard(token)], client_max_size=64 * 1024 * 1024)
    app[CHECKPOINTER] = checkpointer
    if observe is not None:
        app[OBSERVE] = observe
    app.router.add_get(f"{PREFIX}/status", _status)
    for op in _FIELDS:
        app.router.add_post(f"{PREFIX}/{op}", _operation(op))
    if mover is not None:
        app[MOVER] = mover
        app.router.add_post(MOVE_PATH, _move)
    if operations is not None:
        app[OPERATIONS] = operations
        for name, handler in (
            ("drain", _drain),
            ("undrain", _undrain),
            ("restart", _restart),
            ("resize", _resize),
        ):
            app.router.add_post(f"{WORKERS_PATH}/{name}", handler)
    if balancer is not None:
        app[BALANCER] = balancer
    return app
