"""Find the server's app from a `module:attr` string: aiohttp, ASGI, a factory, or a
NeMo Gym server class.

`APP` names one of:
- an aiohttp `Application`;
- an ASGI app: a callable taking `(scope, receive, send)` (a FastAPI or Starlette app,
  an `async def app(scope, receive, send)`);
- a factory: a callable taking no arguments (sync or async) that returns either;
- a NeMo Gym server class (a subclass of `nemo_gym.server_utils.SimpleServer`), built by
  its own `run_webserver()` (`worker.nemo_gym_server`).

The two callables are told apart by their signature (three required positional
parameters, or none), so no `--factory` flag is needed.

A module named `app` inside a package (NeMo Gym's server entrypoint,
`<type>/<name>/app.py`) is imported with its own directory first on the import path, as
NeMo Gym's launcher runs it (`cd <server dir>`, the directory on `PYTHONPATH`): its
servers import their sibling modules by bare name (code_gen: `lcb_integration`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
from typing import Any

from aiohttp import web

from gym_proxy.worker.declaration import declare
from gym_proxy.worker.nemo_gym_server import (
    build_server_app,
    is_server_class,
    nemo_gym_participation,
)

__all__ = ["AppLoadError", "import_app_target", "build_app", "is_asgi_app"]

log = logging.getLogger("gym_proxy.app")


class AppLoadError(Exception):
    """APP does not name an importable aiohttp Application, ASGI app or factory."""


def _required_positional(target: Any) -> int | None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(
        1
        for p in signature.parameters.values()
        if p.kind in kinds and p.default is inspect.Parameter.empty
    )


def is_asgi_app(target: Any) -> bool:
    """True for a callable taking exactly (scope, receive, send)."""
    return callable(target) and _required_positional(target) == 3


def entrypoint_directory(module_name: str) -> str | None:
    """The directory of `<package>.app`, a NeMo Gym server's entrypoint (module
    docstring), without importing the module itself; None for any other module."""
    package, _, last = module_name.rpartition(".")
    if last != "app" or not package:
        return None
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None  # reported by the import itself
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return os.path.dirname(spec.origin)


def import_app_target(spec: str, app_dir: str = ".") -> Any:
    """Import `module:attr` and return the attribute (an app or a factory).

    Raises AppLoadError with a one-line reason; the import error is chained.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise AppLoadError(f"APP must look like module:attr, got {spec!r}")
    if app_dir and app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    own = entrypoint_directory(module_name)
    if own is not None and own not in sys.path:
        sys.path.insert(0, own)
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
    if isinstance(target, web.Application) or is_asgi_app(target) or is_server_class(target):
        return target
    if callable(target) and _required_positional(target) == 0:
        return target
    raise AppLoadError(
        f"{spec} is neither an aiohttp Application, an ASGI app (scope, receive, send) "
        "nor a factory taking no arguments"
    )


async def build_app(
    spec: str, app_dir: str = ".", workers: int = 1, session_state: str | None = None
) -> Any:
    """Import APP and, for a factory, call (and await) it, or build a NeMo Gym server
    class: an aiohttp Application or an ASGI app."""
    target = import_app_target(spec, app_dir)
    if is_server_class(target):
        app = build_server_app(target, workers)
        participation = nemo_gym_participation(target, app, session_state)
        return declare(app, participation)
    if isinstance(target, web.Application) or is_asgi_app(target):
        return target
    app = target()
    if inspect.isawaitable(app):
        app = await app
    if isinstance(app, web.Application) or is_asgi_app(app):
        return app
    raise AppLoadError(
        f"{spec}() returned {type(app).__name__}, not an aiohttp Application or an ASGI app"
    )
