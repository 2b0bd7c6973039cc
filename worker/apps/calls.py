"""How the reference servers call each other: one pooled HTTP client per process.

A call that meets a checkpoint is repeated, as NeMo Gym's servers do: `409
checkpoint_parked` (new work while a participant is closed) and `503` (no worker
answering) are retried after their `Retry-After`, within `CALL_PATIENCE` seconds.
Anything else is the caller's to handle: `CallError` carries the status and body.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import orjson

__all__ = ["CallError", "Reply", "call", "server_url", "TOKEN_HEADER", "OWNER_HEADER"]

TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
OWNER_HEADER = "x-ng-session-owner"
CALL_PATIENCE = float(os.environ.get("GYM_REF_CALL_PATIENCE", "3600"))
_RETRIED = {409: "checkpoint_parked", 503: None}
_client: aiohttp.ClientSession | None = None


class CallError(Exception):
    """A call answered with an error status (after any retries)."""

    def __init__(self, url: str, status: int, body: Any) -> None:
        super().__init__(f"{url} answered {status}: {body}")
        self.status = status
        self.body = body


class Reply:
    """A successful answer: its JSON body and the session token it carried, if any."""

    __slots__ = ("body", "token")

    def __init__(self, body: Any, token: str | None) -> None:
        self.body = body
        self.token = token


def server_url(name: str) -> str:
    """The base URL of another server of the stack, from `GYM_REF_<NAME>_URL`."""
    variable = f"GYM_REF_{name.upper()}_URL"
    url = os.environ.get(variable)
    if not url:
        raise RuntimeError(
            f"{variable} is not set: the stack tells each server where the others are"
        )
    return url.rstrip("/")


def _session() -> aiohttp.ClientSession:
    global _client
    if _client is None or _client.closed:
        _client = aiohttp.ClientSession(
            cookie_jar=aiohttp.DummyCookieJar(),  # sessions travel as explicit tokens
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            connector=aiohttp.TCPConnector(limit=0),
        )
    return _client


async def call(
    url: str, body: Any = None, *, token: str | None = None, owner: str | None = None
) -> Reply:
    """POST `body` as JSON to `url`; the session token travels as NeMo Gym's header."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[TOKEN_HEADER] = token
    if owner is not None:
        headers[OWNER_HEADER] = owner
    data = orjson.dumps(body if body is not None else {})
    give_up = time.monotonic() + CALL_PATIENCE
    while True:
        async with _session().post(url, data=data, headers=headers) as resp:
            raw = await resp.read()
            payload = orjson.loads(raw) if raw else None
            if resp.status < 300:
                return Reply(payload, resp.headers.get(TOKEN_HEADER))
            code = (
                (payload or {}).get("error", {}).get("code") if isinstance(payload, dict) else None
            )
            retried = resp.status in _RETRIED and _RETRIED[resp.status] in (None, code)
            if not retried or time.monotonic() > give_up:
                raise CallError(url, resp.status, payload)
            delay = float(resp.headers.get("Retry-After", "1"))
        await asyncio.sleep(min(delay, 1.0) / 4)  # sooner than asked: resume is quick
