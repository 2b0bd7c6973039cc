"""The supervisor's side of `--preload` (the zygote: `worker.zygote`).

`Zygote.spawn` answers a `ForkedProcess`, which the supervisor uses as it uses an asyncio
subprocess (`pid`, `returncode`, `wait`, `send_signal`, `kill`): a worker forked by the
zygote is the zygote's child, so its exit comes from the zygote's report. If the zygote
itself dies, its workers can no longer be watched: each is killed (SIGKILL by its pid)
and reported exited, so the supervisor replaces it through a new zygote, as after a crash;
the log says why.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys

from gym_proxy.coordinator.contract.lines import LineError, decode_line, encode_line
from gym_proxy.coordinator.contract.zygote_lines import (
    ZYGOTE,
    ChildExited,
    Fork,
    Forked,
    ForkRefused,
)
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.supervision.launchers import Launch, environment_of

__all__ = ["Zygote", "ForkedProcess", "ZygoteError"]

log = logging.getLogger("gym_proxy.supervisor")


class ZygoteError(OSError):
    """The zygote could not fork a worker (it says why)."""


class ForkedProcess:
    """A worker forked by the zygote, as an asyncio subprocess is used."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)


class Zygote:
    """One zygote process: started on first use, and again after it died."""

    def __init__(self, app: str, app_dir: str, limit_line: int, limit_headers: int) -> None:
        self.args = (app, app_dir, str(limit_line), str(limit_headers))
        self.process: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.replies: collections.deque[asyncio.Future[ForkedProcess | str]] = collections.deque()
        self.children: dict[int, ForkedProcess] = {}
        self.lock = asyncio.Lock()  # one fork at a time: replies come in order
        self.environment: dict[str, str] | None = None  # its and its workers', once open

    @classmethod
    def for_config(cls, config: Config) -> Zygote:
        """The zygote of a server started with --preload."""
        return cls(
            config.app, config.app_dir, config.limit_request_line, config.limit_request_headers
        )

    async def open(self, launch: Launch) -> None:
        """The zygote starts on the first spawn, in the workers' environment: an app that
        reads it at import reads theirs."""
        self.environment = environment_of(launch)

    async def spawn(self, argv: list[str]) -> ForkedProcess:
        if self.environment is None:
            raise ZygoteError("the worker launcher is not open")
        async with self.lock:
            if self.writer is None or self.writer.is_closing():
                await self._start()
            assert self.writer is not None
            reply: asyncio.Future[ForkedProcess | str] = asyncio.get_running_loop().create_future()
            self.replies.append(reply)
            self.writer.write(encode_line(Fork(argv, dict(self.environment))))
            await self.writer.drain()
            answer = await reply
        if isinstance(answer, str):
            raise ZygoteError(f"--preload cannot fork a worker: {answer}")
        return answer

    async def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "gym_proxy.worker.zygote",
                str(theirs.fileno()), *self.args,
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=self.environment,
            )  # fmt: skip
        finally:
            theirs.close()
        reader, self.writer = await asyncio.open_unix_connection(sock=ours)
        self.reader_task = asyncio.ensure_future(self._read(reader))
        log.info("--preload: the zygote (pid %d) imports %s once", self.process.pid, self.args[0])

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                message = decode_line(line, ZYGOTE, "the zygote")
                if isinstance(message, ChildExited):
                    child = self.children.pop(message.pid, None)
                    if child is not None:
                        child.exited(message.code)
                    continue
                reply = self.replies.popleft()
                if isinstance(message, Forked):
                    # Known before the next line is read: its exit may be that line.
                    child = self.children[message.pid] = ForkedProcess(message.pid)
                    reply.set_result(child)
                elif isinstance(message, ForkRefused):
                    reply.set_result(message.error)
                else:
                    raise LineError(f"the zygote sent {message.TYPE!r}, which it never sends")
        except LineError as exc:
            log.error("--preload: %s; it is taken as gone", exc)
        finally:
            self._lost()

    def _lost(self) -> None:
        """The zygote is gone: nothing it forked can be watched any more (module doc)."""
        if self.writer is not None:
            self.writer.close()
        while self.replies:
            self.replies.popleft().set_result("the zygote exited")
        if self.children:
            log.error(
                "--preload: the zygote exited; killing its %d workers (they are replaced)",
                len(self.children),
            )
        for child in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child.exited(-signal.SIGKILL)
        self.children.clear()

    async def close(self) -> None:
        """After the workers stopped: the zygote exits as its end of the pair closes."""
        if self.writer is not None:
            self.writer.close()
        if self.process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 5)
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self.reader_task is not None:
            self.reader_task.cancel()
