"""The app's own session ID, read from Starlette's session cookie (pure; no I/O).

NeMo Gym servers keep `{"session_id": <uuid4>}` in Starlette's SessionMiddleware cookie:
`base64(json).<timestamp>.<signature>` (itsdangerous' TimestampSigner), re-sent on every
response. The front door cannot rely on seeing `scope["session"]`: NeMo Gym's own
RolloutContextMiddleware passes a copy of the scope down. So it reads the cookie the
response sets (or, if none, the one the request carried). The signature is the app's to
check; the worker only needs to know which session the app is talking about.

Cookies travel between the servers of a NeMo Gym stack (an agent answers with the
resources server's and the model's cookies too), so the app's own cookie is read by its
name when the app's SessionMiddleware says it (`app_session_cookie`); NeMo Gym names it
`<Class>___<instance>`. Without a name, the first Starlette session cookie is taken.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import orjson

__all__ = [
    "SESSION_KEY",
    "app_session_cookie",
    "session_in_cookie_value",
    "session_in_headers",
    "starlette_app",
]

SESSION_KEY = "session_id"  # NeMo Gym's SESSION_ID_KEY


def session_in_cookie_value(value: bytes) -> str | None:
    """The `session_id` in one Starlette session cookie value, or None."""
    data, dot, rest = value.partition(b".")
    if not dot or rest.count(b".") != 1 or len(data) > 8192:
        return None
    try:
        payload = orjson.loads(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return None
    session_id = payload.get(SESSION_KEY) if isinstance(payload, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def _cookies(header: bytes, set_cookie: bool) -> Iterable[tuple[bytes, bytes]]:
    if set_cookie:  # "name=value; Path=/; ..."
        name, _, value = header.split(b";", 1)[0].partition(b"=")
        yield name.strip(), value.strip().strip(b'"')
        return
    for pair in header.split(b";"):  # "a=1; b=2"
        name, _, value = pair.partition(b"=")
        yield name.strip(), value.strip().strip(b'"')


def session_in_headers(
    headers: Iterable[tuple[bytes, bytes]], set_cookie: bool, cookie: bytes | None = None
) -> str | None:
    """The app session named by a Starlette cookie among `Set-Cookie` (response) or
    `Cookie` (request) headers: the cookie named `cookie`, or the first one that parses."""
    wanted = b"set-cookie" if set_cookie else b"cookie"
    for name, value in headers:
        if name.lower() == wanted:
            for cookie_name, cookie_value in _cookies(value, set_cookie):
                if cookie is not None and cookie_name != cookie:
                    continue
                session_id = session_in_cookie_value(cookie_value)
                if session_id is not None:
                    return session_id
    return None


def starlette_app(app: Any) -> Any | None:
    """The Starlette (or FastAPI) app inside `app`: ASGI middleware keeps the app it wraps
    as `.app` (NeMo Gym's RolloutContextMiddleware, for one). None if there is none."""
    for _ in range(16):  # a bound, should `.app` ever point back
        if hasattr(app, "user_middleware") and hasattr(app, "add_exception_handler"):
            return app
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def app_session_cookie(app: Any) -> str | None:
    """The cookie name of the Starlette SessionMiddleware of `app` (a FastAPI or Starlette
    app, or ASGI middleware wrapping one), if it has one."""
    for middleware in getattr(starlette_app(app), "user_middleware", None) or ():
        if getattr(getattr(middleware, "cls", None), "__name__", "") == "SessionMiddleware":
            kwargs = getattr(middleware, "kwargs", None) or {}
            return str(kwargs.get("session_cookie", "session"))
    return None
