"""An upgrade: a new gym-proxy takes over a running one's listening socket and workers.

A running instance with `--orphan-grace` listens on `take-over.sock` in its runtime
directory (0700, so only its user reaches it). A new instance started with the same
command plus `--take-over` finds that directory (the one whose identity file names its
instance), asks for the listening socket with its secret's fingerprint, and receives the
socket's descriptor over the Unix socket (SCM_RIGHTS: how HAProxy's `-x` and Envoy's hot
restart pass listeners). The port never closes: the old instance stops accepting once
the new one says it has the socket (`PortTaken`; a new instance that goes away
before that leaves the old one serving, ready for the next), and connections that come
before the new one serves wait in the socket's backlog. The old instance then passes
its workers on (they rejoin the new one as after a crash, see
`worker.process`), releases its runtime directory and says so on the same connection
(`DirectoryReleased`), which the new instance waits for before it takes the directory
(`until_released`: an event, not a poll of the directory's lock; the connection's end
does as well, should the old instance die first). Then the old one finishes its open
connections' requests (`proxy.server`).

Every line is a declared message (`TAKE_OVER`, over `coordinator.contract.lines`),
and the request names the protocol's version (TAKE_OVER_VERSION): a running instance
refuses a successor of another version in one line, and a successor refuses an answer
it cannot read, since an upgrade is what crosses this line.

Both ends believe only their own user: the new instance looks only into runtime
directories this uid owns and no one else may write, and sends nothing derived from the
secret before the kernel says the socket's listener runs as this uid (`SO_PEERCRED`);
the old one answers only a peer of its own uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gym_proxy.coordinator.contract.lines import LineError, encode_line, expect
from gym_proxy.coordinator.contract.messages import Message, message
from gym_proxy.coordinator.contract.trust import SOCKET, Untrusted, check_owned, own_peer, peer_of
from gym_proxy.proxy.runtime_dir import PREFIX, read_identity, trusted_directory

__all__ = [
    "TAKE_OVER",
    "TAKE_OVER_VERSION",
    "TAKE_OVER_SOCKET",
    "TakeOverAsk",
    "PortPassed",
    "TakeOverRefused",
    "PortTaken",
    "DirectoryReleased",
    "TakeOver",
    "TakeOverError",
    "PassOnListener",
    "take_over_running",
    "until_released",
]

log = logging.getLogger("gym_proxy")

TAKE_OVER_SOCKET = "take-over.sock"
REQUEST_WAIT = 5.0  # seconds a connection gets to send its request
TOOK_WAIT = 10.0  # seconds the new instance gets to say it has the socket
RELEASE_WAIT = 30.0  # seconds the new instance waits for the old one's directory


TAKE_OVER_VERSION = 1  # of the messages below; another is refused by either end
TAKE_OVER: dict[str, type[Message]] = {}  # the take-over's messages, by wire type


@message("take_over", TAKE_OVER)
class TakeOverAsk(Message):
    """New -> running: the listening socket, please (the secret's fingerprint proves
    the same secret)."""

    version: int
    secret: str


@message("port", TAKE_OVER)
class PortPassed(Message):
    """Running -> new: the listening socket goes with this message (SCM_RIGHTS)."""

    version: int


@message("refused", TAKE_OVER)
class TakeOverRefused(Message):
    """Running -> new: no take-over, and why."""

    error: str


@message("took", TAKE_OVER)
class PortTaken(Message):
    """New -> running: it has the socket; the running instance stops accepting."""


@message("released", TAKE_OVER)
class DirectoryReleased(Message):
    """Running -> new: the runtime directory is free for the new instance to take."""


class TakeOverError(Exception):
    """Nothing to take over, or the running instance refused (the message says which)."""


@dataclass(frozen=True)
class TakeOver:
    """What a new instance got from the running one: its listening socket, and the
    connection on which the old one says it released its runtime directory."""

    listen_sock: socket.socket
    conversation: socket.socket


def take_over_running(parent: str | None, instance: str, fingerprint: str) -> TakeOver:
    """The listening socket of the running instance `instance` under `parent`."""
    parent = parent or tempfile.gettempdir()
    path = _running(parent, instance)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(path)
        own_peer(conn, path)  # before anything derived from the secret goes out
        conn.sendall(encode_line(TakeOverAsk(TAKE_OVER_VERSION, fingerprint)))
        line, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        try:
            answer = expect(line, TAKE_OVER, "the running gym-proxy", PortPassed, TakeOverRefused)
            if isinstance(answer, TakeOverRefused):
                raise TakeOverError(
                    f"the running gym-proxy of instance {instance} refused: {answer.error}"
                )
            if not (isinstance(answer, PortPassed) and answer.version == TAKE_OVER_VERSION and fds):
                raise LineError(f"the running gym-proxy sent no socket: {line[:60]!r}")
        except (LineError, TakeOverError):
            for fd in fds:  # the running one keeps serving: it heard no `took`
                os.close(fd)
            raise
        conn.sendall(encode_line(PortTaken()))
    except (OSError, Untrusted, LineError) as exc:
        conn.close()
        raise TakeOverError(f"cannot take over the gym-proxy at {path}: {exc}") from None
    except TakeOverError:
        conn.close()
        raise
    conn.setblocking(False)
    return TakeOver(socket.socket(fileno=fds[0]), conn)


async def until_released(conversation: socket.socket, within: float = RELEASE_WAIT) -> bool:
    """Until the old instance says it released its runtime directory, or its end of the
    conversation closes (it died: the kernel released the directory's lock with it).
    False after `within` seconds without either."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(within):
            while await loop.sock_recv(conversation, 4096):
                pass  # DirectoryReleased, then the end; the end is what counts
    except TimeoutError:
        return False
    except OSError:
        pass  # reset by a dying peer: as good as its end
    finally:
        conversation.close()
    return True


def _running(parent: str, instance: str) -> str:
    """The take-over socket of the running instance named `instance` under `parent`
    (only in a directory, and a socket, of this user's)."""
    foreign = 0  # other users' gym-proxy directories, never looked into
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(PREFIX):
                continue
            if not trusted_directory(entry.path):
                foreign += 1
                continue
            identity = read_identity(entry.path)
            path = os.path.join(entry.path, TAKE_OVER_SOCKET)
            if identity is not None and identity.get("instance") == instance:
                if _own_socket(path):
                    return path
    skipped = f"; {foreign} directories of other users skipped" if foreign else ""
    raise TakeOverError(
        f"no running gym-proxy of instance {instance} under {parent} to take over "
        f"(it must run with the same secret and --runtime-dir, --orphan-grace not 0{skipped})"
    )


def _own_socket(path: str) -> bool:
    """Whether `path` is a socket this user made (its listener is checked on connect)."""
    try:
        info = os.lstat(path)
        check_owned(info, path, SOCKET)
    except (OSError, Untrusted):
        return False
    return stat.S_ISSOCK(info.st_mode)


class PassOnListener:
    """The running instance's end: hands `listen_sock` to the first new instance that
    proves the same secret, then calls `on_passed` with its pid (once). While `blocker`
    names something the new instance could not carry on (an open checkpoint, a running move or live
    operation: their state is this process's), the take-over is refused with that (what
    only gives way, a rebalance, has been asked to first: `Exclusion.blocking_take_over`)."""

    def __init__(
        self,
        fingerprint: str,
        listen_sock: socket.socket,
        on_passed: Callable[[int], None],
        blocker: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self._fingerprint = fingerprint
        self._listen_sock = listen_sock
        self._on_passed = on_passed
        self._blocker = blocker
        self._server: asyncio.AbstractServer | None = None
        self._successor: asyncio.StreamWriter | None = None  # told when the directory is free
        self.passing = False

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            own_peer(writer.get_extra_info("socket"), TAKE_OVER_SOCKET)
            line = await asyncio.wait_for(reader.readline(), REQUEST_WAIT)
        except (TimeoutError, ValueError, ConnectionError, Untrusted):
            writer.close()
            return
        why = None
        try:
            request = expect(line, TAKE_OVER, "the new gym-proxy", TakeOverAsk)
        except LineError as exc:
            why = f"{exc} (a gym-proxy of another version?)"
        else:
            if request.version != TAKE_OVER_VERSION:
                why = (
                    f"the new gym-proxy speaks take-over protocol {request.version}, this one "
                    f"{TAKE_OVER_VERSION}: stop this one and start the new one instead"
                )
            elif self.passing:
                why = "it is being taken over already"
            elif request.secret != self._fingerprint:
                why = "another secret"
            elif self._blocker is not None:
                why = await self._blocker()
        if why is not None:
            writer.write(encode_line(TakeOverRefused(why)))
            writer.close()
            return
        self.passing = True  # refuses a second one while this one is answered
        try:
            pid = await self._pass_socket(reader, writer)
        except (OSError, TimeoutError, ValueError) as exc:
            self.passing = False
            writer.close()
            log.warning(
                "a take-over did not happen: the new gym-proxy went before it had the port "
                "(%s); serving on",
                exc or type(exc).__name__,
            )
            return
        self._successor = writer
        self._on_passed(pid)

    async def _pass_socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        """Send the listening socket and wait until the new instance says it has it; its
        pid. OSError, TimeoutError or ValueError when it went away first (nothing changed
        here: this instance still serves)."""
        transport_socket = writer.get_extra_info("socket")
        peer = socket.socket(fileno=os.dup(transport_socket.fileno()))
        passed = encode_line(PortPassed(TAKE_OVER_VERSION))
        try:  # one small message on a new connection: it fits the socket's buffer
            socket.send_fds(peer, [passed], [self._listen_sock.fileno()])
            pid = peer_of(peer).pid
        finally:
            peer.close()
        line = await asyncio.wait_for(reader.readline(), TOOK_WAIT)
        expect(line, TAKE_OVER, "the new gym-proxy", PortTaken)  # LineError: a ValueError
        return pid

    def released(self) -> None:
        """The runtime directory is free: the successor may take it now."""
        successor, self._successor = self._successor, None
        if successor is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                successor.write(encode_line(DirectoryReleased()))
            successor.close()

    async def close(self) -> None:
        self.released()  # the directory goes with this process in any case
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
