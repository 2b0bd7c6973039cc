"""The Ray process of one gym-proxy: it starts the server's one local Ray cluster, or
checks that a named one can be joined, and says so in one JSON line on stdout.

Run by `proxy.ray_cluster` as `python -m gym_proxy.proxy.ray_head start|check [ADDRESS]`: the
driver of the cluster is this process, never the proxy (Ray's driver threads and signal
handlers stay out of the proxy's event loop, and the proxy never imports Ray for this;
an app module that imports Ray at its top, as code_gen's does, is the app's doing).

- `start`: `ray.init(address="local")`, a new cluster whatever the host runs (never one
  found by a session file: gym-proxy attaches to no cluster nobody named), with Ray's own
  defaults as NeMo Gym's `initialize_ray()` has them, token authentication included;
  prints `{"address", "auth_mode"}`, then holds the cluster until its stdin ends (the
  proxy stops it, or died) or it is sent SIGTERM/SIGINT, and shuts it down. Should this
  process be killed, Ray's own reaper stops the cluster.
- `check ADDRESS`: joins the cluster as a driver, with token authentication when a token
  is at hand and RAY_AUTH_MODE is unset (as `ray start --head` decides it), prints
  `{"address", "auth_mode"}` and leaves; a cluster that cannot be joined prints
  `{"error": "<one line>"}` and exits 1, within seconds.

Ray's own chatter goes to stderr (the proxy's log).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from typing import Any

__all__ = ["main"]

AUTH_MODE = "RAY_AUTH_MODE"
CONNECT_TIMEOUT = 5.0  # seconds for the TCP probe of a named cluster's GCS address
GCS_WAIT = 4  # seconds Ray may retry a named cluster's GCS when joining it


def _say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _start() -> int:
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    _say(address=ray.get_runtime_context().gcs_address, auth_mode=os.environ.get(AUTH_MODE))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def until_stdin_closes() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    done.wait()
    ray.shutdown()
    return 0


def _probe(address: str) -> str | None:
    """Why nothing answers at `address` (host:port), or None when something does."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"the Ray address {address!r} is not HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT):
            return None
    except OSError as exc:
        return f"nothing answers at the Ray address {address}: {exc.strerror or exc}"


def _join_with_a_token_at_hand() -> None:
    """Ray 2.60 turns token authentication on by itself only for a cluster `ray.init()`
    starts or finds, and `ray start --head` when RAY_AUTH_MODE is unset and a token is at
    hand; `ray start --address` never does (a token cluster refuses it without
    RAY_AUTH_MODE=token). A named cluster is joined as `ray start --head` decides."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _why(exc: BaseException) -> str:
    """The one line that says why a join failed: Ray wraps the cause in a generic
    ConnectionError, and an authentication refusal only shows in the cause's text."""
    text = "".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None)
    if "Unauthenticated" in text or "InvalidAuthToken" in text:
        mode = os.environ.get(AUTH_MODE) or "unset"
        return (
            f"it refused this process's authentication (RAY_AUTH_MODE {mode}; a cluster with "
            "token authentication needs its token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token)"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first


def _check(address: str) -> int:
    why = _probe(address)
    if why is not None:
        _say(error=why)
        return 1
    # Ray retries a GCS that does not answer for about 20 s; something listens there, so
    # a few seconds tell (an authentication refusal is answered at once, and retried).
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_WAIT))
    _join_with_a_token_at_hand()
    import ray

    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError, ...
        _say(error=f"cannot join the Ray cluster at {address}: {_why(exc)}")
        return 1
    _say(address=ray.get_runtime_context().gcs_address, auth_mode=os.environ.get(AUTH_MODE))
    ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["start"]:
        return _start()
    if len(args) == 2 and args[0] == "check":
        return _check(args[1])
    print("usage: python -m gym_proxy.proxy.ray_head start | check HOST:PORT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
