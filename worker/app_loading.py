"""Find the server's aiohttp application from a `module:attr` string."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from aiohttp import web

__all__ = ["AppLoadError", "import_app_target", "build_app"]


class AppLoadError(Exception):
    """APP does not name an importable aiohttp Application or factory."""


def import_app_target(spec: str, app_dir: str = ".") -> Any:
    """Import `module:attr` and return the attribute (an Application or a callable).

    Raises AppLoadError with a one-line reason; the import error is chained.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise AppLoadError(f"APP must look like module:attr, got {spec!r}")
    if app_dir and app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AppLoadError(f"cannot import module {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise AppLoadError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(target, web.Application) and not callable(target):
        raise AppLoadError(f"{spec} is neither an aiohttp Application nor a factory")
    return target


async def build_app(spec: str, app_dir: str = ".") -> web.Application:
    """Import APP and, for a factory, call (and await) it."""
    target = import_app_target(spec, app_dir)
    if isinstance(target, web.Application):
        return target
    app = target()
    if inspect.isawaitable(app):
        app = await app
    if not isinstance(app, web.Application):
        raise AppLoadError(f"{spec}() returned {type(app).__name__}, not an aiohttp Application")
    return app
