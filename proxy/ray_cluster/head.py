"""The Ray process of one gym-proxy: it starts the server's one local Ray cluster, or
checks that a named one can be joined, and says so in one line on stdout (the messages:
`proxy.ray_cluster.lines.RAY_HEAD`).

Run by `proxy.ray_cluster.cluster` as `python -m gym_proxy.proxy.ray_cluster.head
start|check [ADDRESS]`: the driver of the cluster is this process, never the proxy (Ray's
driver threads and signal handlers stay out of the proxy's event loop, and the proxy never
imports Ray for this; an app module that imports Ray at its top, as code_gen's does, is the
app's doing).

- `start [KEEP_FOR SOCKET]`: `ray.init(address="local")`, a new cluster whatever the host
  runs (never one found by a session file: gym-proxy attaches to no cluster nobody
  named), with Ray's own defaults as NeMo Gym's `initialize_ray()` has them, token
  authentication included; says `cluster` (its address and authentication mode), then
  holds the cluster for its holder, first the proxy at its stdin, and shuts it down when
  the holder says `stop` (or said `stopping` earlier and then leaves), or on
  SIGTERM/SIGINT. A holder that goes without either (gym-proxy died, or
  handed its workers over) leaves the cluster waiting KEEP_FOR seconds for the next one
  to connect to SOCKET (in the runtime directory, which a successor adopts), which gets
  the same line and holds it from then on; with none, or no SOCKET, it shuts down. Should
  this process be killed, Ray's own reaper stops the cluster. A line of its holder's it
  cannot read is refused on stderr, in one line, and changes nothing.
- `check ADDRESS`: joins the cluster as a driver, with token authentication when a token
  is at hand and RAY_AUTH_MODE is unset (as `ray start --head` decides it), says
  `cluster` and leaves; a cluster that cannot be joined says `error` (one line) and exits
  1, within seconds.

Ray's own chatter goes to stderr (the proxy's log).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from gym_proxy.coordinator.contract.exit_codes import FAILED, USAGE_ERROR
from gym_proxy.coordinator.contract.lines import LineError, decode_line, encode_line
from gym_proxy.coordinator.contract.messages import Message
from gym_proxy.proxy.ray_cluster.lines import (
    HOLDER,
    RAY_HEAD,
    ClusterAddress,
    HeadError,
    StopCluster,
    Stopping,
)

__all__ = ["main"]

AUTH_MODE = "RAY_AUTH_MODE"
CONNECT_TIMEOUT = 5.0  # seconds for the TCP probe of a named cluster's GCS address
GCS_WAIT = 4  # seconds Ray may retry a named cluster's GCS when joining it


def _say(said: Message) -> None:
    sys.stdout.buffer.write(encode_line(said))
    sys.stdout.flush()


def _start(keep_for: float = 0.0, socket_path: str | None = None) -> int:
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    line = encode_line(
        ClusterAddress(ray.get_runtime_context().gcs_address, os.environ.get(AUTH_MODE))
    )
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
    holder = _Holder()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: holder.stop())
    holder.follow(sys.stdin.buffer.readline)
    listener = _listen(socket_path) if socket_path and keep_for > 0 else None
    while holder.wait():  # the holder left without `stop`
        conn = _next_holder(listener, keep_for, holder) if listener is not None else None
        if conn is None:
            break
        try:
            conn.sendall(line)
        except OSError:  # it went away at once: wait for another
            conn.close()
            holder.follow(lambda: b"")
            continue
        holder.follow(conn.makefile("rb").readline)
    ray.shutdown()
    return 0


class _Holder:
    """Who holds the cluster: `stop` ends it, a holder that leaves without it lets the
    next one in (`_start`)."""

    def __init__(self) -> None:
        self._changed = threading.Event()
        self._stopped = False
        self._gone = False
        self._final = False

    def stop(self) -> None:
        self._stopped = True
        self._changed.set()

    def follow(self, readline: Callable[[], bytes]) -> None:
        """Read the holder's lines (in a thread) until `stop` or its end."""
        self._gone = self._final = False
        self._changed.clear()

        def read() -> None:
            try:
                while line := readline():
                    said = _read(line)
                    if isinstance(said, StopCluster):
                        self.stop()
                        return
                    if isinstance(said, Stopping):  # its end will be a stop: wait for none
                        self._final = True
            except OSError:
                pass
            if self._final:
                self.stop()
                return
            self._gone = True
            self._changed.set()

        threading.Thread(target=read, daemon=True).start()

    def wait(self) -> bool:
        """Until something changes: True when the holder left without `stop`."""
        while not (self._changed.wait(0.5) or self._stopped):
            pass  # the timeout lets a signal's handler run, and its stop be seen
        return self._gone and not self._stopped

    @property
    def stopped(self) -> bool:
        return self._stopped


def _read(line: bytes) -> Message | None:
    """The holder's message in `line`; None, said on stderr, for one this cannot read."""
    try:
        return decode_line(line, RAY_HEAD, HOLDER)
    except LineError as exc:
        print(f"gym-proxy Ray process: {exc}; ignored", file=sys.stderr, flush=True)
        return None


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(0.5)  # a signal's stop is seen within this
    return listener


def _next_holder(listener: socket.socket, keep_for: float, holder: _Holder) -> socket.socket | None:
    """The next holder to connect within `keep_for` seconds; None when none does (or a
    signal stops the cluster meanwhile)."""
    deadline = time.monotonic() + keep_for
    while time.monotonic() < deadline and not holder.stopped:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        return conn
    return None


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
        _say(HeadError(why))
        return FAILED
    # Ray retries a GCS that does not answer for about 20 s; something listens there, so
    # a few seconds tell (an authentication refusal is answered at once, and retried).
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_WAIT))
    _join_with_a_token_at_hand()
    import ray

    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError, ...
        _say(HeadError(f"cannot join the Ray cluster at {address}: {_why(exc)}"))
        return FAILED
    _say(ClusterAddress(ray.get_runtime_context().gcs_address, os.environ.get(AUTH_MODE)))
    ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["start"]:
        return _start()
    if len(args) == 3 and args[0] == "start":
        return _start(float(args[1]), args[2])
    if len(args) == 2 and args[0] == "check":
        return _check(args[1])
    print(
        "usage: python -m gym_proxy.proxy.ray_cluster.head "
        "start [KEEP_FOR SOCKET] | check HOST:PORT",
        file=sys.stderr,
    )
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
