"""`--preload`: the process that imports the app once and forks each worker from itself.

A NeMo Gym server module takes 3.5 to 5 s of CPU to import (openai's types, scipy,
pydantic models), and without a preload every worker pays it at every start: a boot, a
replacement after a crash, each slot of a rolling restart, a resize. Like gunicorn's
`--preload` (and Python's forkserver with its preload list), the zygote imports the app's
module and gym-proxy's worker code once; a worker forked from it starts with both in
memory (shared copy-on-write) and only builds its app.

It is started by the supervisor (`proxy.fleet.supervision.zygote_client`) with one end of a socket
pair (its descriptor the first argument) and serves it, one declared message a line
(`coordinator.contract.zygote_lines`): a `fork` gets `forked` or `refused`, in the order
asked, and a worker's end is reported `exited`; a line it cannot read is refused.

The zygote runs no event loop and no thread (fork copies only the calling thread), and
checks it still has one thread after the import: an app module that starts threads at
import cannot be forked safely, so it refuses every fork with why, and gym-proxy says so.
When the proxy's end closes, it exits; its workers go on until their coordinator
channel closes, as workers started without it do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import NoReturn

from gym_proxy.coordinator.contract.lines import LineError, encode_line, expect
from gym_proxy.coordinator.contract.messages import Message
from gym_proxy.coordinator.contract.zygote_lines import (
    ZYGOTE,
    ChildExited,
    Fork,
    Forked,
    ForkRefused,
)

__all__ = ["main"]


def _preload(app: str, app_dir: str, line: int, headers: int) -> str:
    """Import what every worker imports; answer why forking is unsafe ("" when it is
    not). A failed import is not fatal: each worker imports again and reports it as a
    boot error, as without the zygote."""
    from gym_proxy.worker.head_limits import head_limits

    head_limits(line, headers).raise_websockets_limits()  # as the worker does: first
    try:
        import gym_proxy.worker.process  # noqa: F401
        from gym_proxy.worker.app_loading import import_app_target

        import_app_target(app, app_dir)
    except BaseException:  # noqa: BLE001 - reported by each worker's own import
        pass
    from gym_proxy.coordinator.contract.collector import freeze_startup_heap

    freeze_startup_heap()  # before any fork: no worker's collection copies these pages
    threads = threading.active_count()
    if threads > 1:
        names = ", ".join(sorted(t.name for t in threading.enumerate()))
        return f"importing {app} started {threads - 1} threads ({names}); fork is unsafe"
    return ""


def _child(argv: list[str], env: dict[str, str], cwd: str, conn: socket.socket) -> NoReturn:
    """In the forked worker: the zygote's state off, the proxy's environment on, the
    worker's own entry point, then its exit (`_leave`)."""
    conn.close()
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [os.path.join(os.path.dirname(__file__), "__main__.py"), *argv]
    code = 1
    try:
        from gym_proxy.worker.process import main

        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - its traceback, as the interpreter prints it
        traceback.print_exc()
    _leave(code)


def _leave(code: int) -> NoReturn:
    """A worker's exit as the interpreter's, without its teardown of every module: that
    decrefs every object the zygote imported, which copies each page it shares with the
    zygote (0.1-0.5 s of a stop here; NeMo Gym's launcher gives a server 1 s). Threads are
    joined and atexit handlers run, as at a normal exit."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _send(conn: socket.socket, message: Message) -> None:
    conn.sendall(encode_line(message))


def _reap(conn: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(conn, ChildExited(pid, os.waitstatus_to_exitcode(status)))


def _passed_fd(request: Fork, passed: list[int]) -> int:
    """The descriptor sent with `request` (-1 when it carries none): a line that says it
    carries one arrives with it (its sender waits for each answer before the next)."""
    if not request.fd:
        return -1
    if not passed:
        raise LineError("fork: fd is true but no descriptor came with the line")
    return passed.pop(0)


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def serve(conn: socket.socket, unsafe: str) -> None:
    """Fork a worker for each request until the proxy's end closes."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up byte is what counts
    selector = selectors.DefaultSelector()
    selector.register(conn, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""
    passed: list[int] = []  # descriptors received, for the forks that said they carry one
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                while True:
                    try:
                        if not wake_r.recv(4096):
                            break
                    except BlockingIOError:
                        break
                _reap(conn)
                continue
            data, fds, _, _ = socket.recv_fds(conn, 65536, 16)
            passed.extend(fds)
            if not data:
                return  # the proxy is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = expect(line, ZYGOTE, "gym-proxy", Fork)
                    fd = _passed_fd(request, passed)
                except LineError as exc:
                    _send(conn, ForkRefused(str(exc)))
                    continue
                if unsafe:
                    _close(fd)
                    _send(conn, ForkRefused(unsafe))
                    continue
                argv = [a.replace("{fd}", str(fd)) for a in request.argv]
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    wake_r.close()
                    wake_w.close()
                    _child(argv, request.env, request.cwd, conn)
                _close(fd)  # the worker's own now
                _send(conn, Forked(pid))


def main() -> None:
    fd, app, app_dir, line, headers = sys.argv[1:6]
    conn = socket.socket(fileno=int(fd))
    # SIGTERM and SIGINT for the proxy's process group are the proxy's to act on; the
    # zygote ends when the proxy's end of the pair closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    unsafe = _preload(app, app_dir, int(line), int(headers))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(conn, unsafe)
    # The proxy is gone or stopping, and waits for this exit: none of the interpreter's
    # teardown (its collections walk every object the app imported, seconds for NeMo
    # Gym's), which has nothing to do here.
    os._exit(0)


if __name__ == "__main__":
    main()
