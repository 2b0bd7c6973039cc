"""Where an app keeps its own sessions: the Starlette app inside ASGI middleware, and the
name of its session cookie (reading the cookie is `coordinator.contract.app_sessions`).

The front door cannot rely on seeing `scope["session"]`: NeMo Gym's own
RolloutContextMiddleware passes a copy of the scope down. So it reads the cookie the
response sets (or, if none, the one the request carried), by the name the app's
SessionMiddleware gives it (`app_session_cookie`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["app_session_cookie", "starlette_app"]


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
