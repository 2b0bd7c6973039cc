"""gym-proxy in the test's own event loop: the real `proxy.server.run`, its supervisor,
channels, router, data path, control app and live operations, with every worker the real
`worker.process.serve` run as a task instead of a process.

Everything talks over real sockets (the public port on loopback, the workers' and the
coordinator's Unix sockets), so a request, a move or a rolling restart takes the path it
takes in production; only process starts are left out (a worker is ready in milliseconds,
not the 0.4 s its imports take). The proxy stops the way users stop it, with SIGTERM
(`signal.raise_signal`: its handler is the proxy's while it runs). The test runs on
uvloop, as gym-proxy does (`tests/conftest.py`). What needs a process stays with
`tests.support.ProxyProcess`: kill -9, SIGSTOP, a process's memory, its log and exit
code, environment a process reads once at start (websockets' header limits, read when
it is first imported, are the test process's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

from gym_proxy.proxy.config import config_from_args
from gym_proxy.proxy.fleet.supervision.launchers import Launch
from gym_proxy.proxy.server import run
from gym_proxy.worker.options import parse_worker_args
from gym_proxy.worker.process import serve
from tests.support import TEST_SECRET, wait_until

__all__ = ["InProcessProxy", "TaskWorker", "TaskLauncher", "in_process_proxies"]

log = logging.getLogger("tests.in_process")

# The test apps' aiohttp and ASGI twins, one server to checkpoints (`tests/conftest.py`).
TWIN_APPS = ("tests.apps:create_app", "tests.asgi_apps:create_app")

# Past any real PID (Linux's pid_max is at most 2**22): a signal sent to one by mistake
# finds no process instead of the test's own.
_PIDS = itertools.count(1 << 23)


class TaskWorker:
    """A worker run as a task, with the face of a subprocess (`WorkerHandle`): SIGTERM
    stops it gracefully, SIGKILL cancels it (its channel closes first, as a dead
    process's would)."""

    def __init__(self, argv: list[str]) -> None:
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.args = parse_worker_args(argv)
        self._stop = asyncio.Event()
        self._exited = asyncio.Event()
        self.task = asyncio.ensure_future(serve(self.args, self._stop))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future[int]) -> None:
        if task.cancelled():
            self.returncode = -signal.SIGKILL
        elif task.exception() is not None:
            log.error("worker %d failed", self.args.slot, exc_info=task.exception())
            self.returncode = 1
        else:
            self.returncode = task.result()
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int, /) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        if sig == signal.SIGKILL:
            self.task.cancel()
        elif sig == signal.SIGTERM:
            self._stop.set()
        else:
            raise ValueError(f"a task worker takes SIGTERM or SIGKILL, not {sig}")

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class TaskLauncher:
    """Starts each worker as a `TaskWorker` (the supervisor's `WorkerLauncher`)."""

    def __init__(self) -> None:
        self.started: list[TaskWorker] = []
        self.launch: Launch | None = None  # what the server opened it with

    async def open(self, launch: Launch) -> None:
        self.launch = launch  # the workers share this process's environment: not applied

    async def spawn(self, argv: list[str]) -> TaskWorker:
        if self.launch is None:
            raise OSError("the worker launcher is not open")
        worker = TaskWorker(argv)
        self.started.append(worker)
        return worker

    async def close(self) -> None:
        for worker in self.started:
            if worker.returncode is None:
                worker.kill()
        await asyncio.gather(*(w.wait() for w in self.started))


class InProcessProxy:
    """One gym-proxy running in this event loop on a loopback port."""

    def __init__(
        self,
        *args: str,
        workers: int = 2,
        app: str = "tests.apps:create_app",
        control_token: str | None = None,
    ) -> None:
        self.runtime_parent = tempfile.mkdtemp(prefix="gpt-", dir="/tmp")
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if app in TWIN_APPS and "--name" not in args:
            args = (*args, "--name", "apps")  # as `start_proxy` names them: one server
        argv = [app, "--workers", str(workers), "--runtime-dir", self.runtime_parent]
        argv += ["--secret", TEST_SECRET, *args]
        if control_token is not None:
            argv += ["--control-token", control_token]
        self.config = config_from_args(argv)
        self.cookie = self.config.session_cookie
        self.launcher = TaskLauncher()
        self.task: asyncio.Task[int] | None = None
        self._lines: list[str] = []
        self._handler = _Lines(self._lines)
        self._logger = logging.getLogger("gym_proxy")
        self._level = self._logger.level

    def worker_pids(self) -> list[int]:
        """The (made-up) PIDs of the workers running now, in start order: the ones the
        proxy reports."""
        return [w.pid for w in self.launcher.started if w.returncode is None]

    def log(self) -> str:
        """What gym-proxy and its workers logged, a line each, as a process's log reads."""
        return "\n".join(self._lines)

    def signal(self, sig: int) -> None:
        """A signal to gym-proxy (it is this process's while the proxy runs)."""
        signal.raise_signal(sig)

    async def start(self, within: float = 30.0) -> InProcessProxy:
        secret = TEST_SECRET.encode()
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)
        self.task = asyncio.create_task(
            run(self.config, self.listener, secret, launcher=self.launcher)
        )
        # The port listens once every worker has registered (`proxy.server`).
        await wait_until(self._answers, within, "the in-process gym-proxy to listen")
        return self

    async def _answers(self) -> bool:
        assert self.task is not None
        if self.task.done():
            raise AssertionError(f"gym-proxy stopped while starting: {self.task.result()}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return False
        writer.close()
        return True

    async def stop(self, within: float = 30.0) -> int:
        """SIGTERM, as a user stops it; answers its exit code."""
        assert self.task is not None
        if not self.task.done():
            await asyncio.sleep(0)  # its first step installs its signal handlers
            signal.raise_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.task, within)
        finally:
            self._logger.removeHandler(self._handler)
            self._logger.setLevel(self._level)
        self.listener.close()
        shutil.rmtree(self.runtime_parent, ignore_errors=True)
        return code


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines
        self.setFormatter(logging.Formatter("%(asctime)s gym-proxy %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextlib.asynccontextmanager
async def in_process_proxies() -> AsyncIterator[Callable[..., Any]]:
    """Start in-process gym-proxies (one at a time: SIGTERM is the process's); each is
    stopped after, however the test ended."""
    started: list[InProcessProxy] = []

    async def start(*args: str, **kwargs: Any) -> InProcessProxy:
        running = [p for p in started if p.task is not None and not p.task.done()]
        assert not running, "one in-process gym-proxy at a time (they share SIGTERM)"
        proxy = InProcessProxy(*args, **kwargs)
        started.append(proxy)
        return await proxy.start()

    try:
        yield start
    finally:
        for proxy in started:
            if proxy.task is not None:
                await proxy.stop()
