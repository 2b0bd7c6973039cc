"""An upgrade: a new gym-proxy takes over a running one's listening socket and workers.

A running instance with `--orphan-grace` listens on `takeover.sock` in its runtime
directory (0700, so only its user reaches it). A new instance started with the same
command plus `--take-over` finds that directory (the one whose identity file names its
instance), asks for the listening socket with its secret's fingerprint, and receives the
socket's descriptor over the Unix socket (SCM_RIGHTS: how HAProxy's `-x` and Envoy's hot
restart pass listeners). The port never closes: the old instance stops accepting once
the new one says it has the socket (`{"took": true}`; a new instance that goes away
before that leaves the old one serving, ready for the next), and connections that come
before the new one serves wait in the socket's backlog. The old instance then passes
its workers on (they rejoin the new one as after a crash, see
`worker.process`), releases its runtime directory and says so on the same connection
(`{"released": true}`), which the new instance waits for before it takes the directory
(`until_released`: an event, not a poll of the directory's lock; the connection's end
does as well, should the old instance die first). Then the old one finishes its open
connections' requests (`proxy.server`).

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

import orjson

from gym_proxy.coordinator.contract.trust import SOCKET, Untrusted, check_owned, own_peer, peer_of
from gym_proxy.proxy.runtime_dir import PREFIX, read_identity, trusted_directory

__all__ = [
    "TAKEOVER_NAME",
    "TakeOver",
    "TakeOverError",
    "TakeOverListener",
    "take_over_listener",
    "until_released",
]

log = logging.getLogger("gym_proxy")

TAKEOVER_NAME = "takeover.sock"
REQUEST_WAIT = 5.0  # seconds a connection gets to send its request
TOOK_WAIT = 10.0  # seconds the new instance gets to say it has the socket
RELEASE_WAIT = 30.0  # seconds the new instance waits for the old one's directory


class TakeOverError(Exception):
    """Nothing to take over, or the running instance refused (the message says which)."""


@dataclass(frozen=True)
class TakeOver:
    """What a new instance got from the running one: its listening socket, and the
    connection on which the old one says it released its runtime directory."""

    listen_sock: socket.socket
    conversation: socket.socket


def take_over_listener(parent: str | None, instance: str, fingerprint: str) -> TakeOver:
    """The listening socket of the running instance `instance` under `parent`."""
    parent = parent or tempfile.gettempdir()
    path = _running(parent, instance)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(path)
        own_peer(conn, path)  # before anything derived from the secret goes out
        conn.sendall(orjson.dumps({"secret": fingerprint}) + b"\n")
        message, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        if fds:
            conn.sendall(orjson.dumps({"took": True}) + b"\n")
    except (OSError, Untrusted) as exc:
        conn.close()
        raise TakeOverError(f"cannot take over the gym-proxy at {path}: {exc}") from None
    if not fds:
        conn.close()
        raise TakeOverError(
            f"the running gym-proxy of instance {instance} refused: {_reason(message)}"
        )
    conn.setblocking(False)
    return TakeOver(socket.socket(fileno=fds[0]), conn)


def _reason(message: bytes) -> str:
    """Why the running instance refused, from its answer (which may be anything)."""
    if not message:
        return "it closed the connection"
    try:
        answer = orjson.loads(message)
    except orjson.JSONDecodeError:
        return "its answer is not JSON"
    reason = answer.get("error") if isinstance(answer, dict) else None
    return reason if isinstance(reason, str) else "no reason given"


async def until_released(conversation: socket.socket, within: float = RELEASE_WAIT) -> bool:
    """Until the old instance says it released its runtime directory, or its end of the
    conversation closes (it died: the kernel released the directory's lock with it).
    False after `within` seconds without either."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(within):
            while await loop.sock_recv(conversation, 4096):
                pass  # `{"released": true}`, then the end; the end is what counts
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
            path = os.path.join(entry.path, TAKEOVER_NAME)
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


class TakeOverListener:
    """The running instance's end: hands `listen_sock` to the first new instance that
    proves the same secret, then calls `on_taken` (once). While `busy` names something
    the new instance could not carry on (an open checkpoint, a running move or live
    operation: their state is this process's), the take-over is refused with that; what
    only gives way (a rebalance) is waited for first (`give_way`)."""

    def __init__(
        self,
        fingerprint: str,
        listen_sock: socket.socket,
        on_taken: Callable[[int], None],
        busy: Callable[[], str | None] = lambda: None,
        give_way: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._fingerprint = fingerprint
        self._listen_sock = listen_sock
        self._on_taken = on_taken
        self._busy = busy
        self._give_way = give_way
        self._server: asyncio.AbstractServer | None = None
        self._successor: asyncio.StreamWriter | None = None  # told when the directory is free
        self.taken = False

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            own_peer(writer.get_extra_info("socket"), TAKEOVER_NAME)
            line = await asyncio.wait_for(reader.readline(), REQUEST_WAIT)
            request = orjson.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except (TimeoutError, ValueError, orjson.JSONDecodeError, ConnectionError, Untrusted):
            writer.close()
            return
        if self._give_way is not None:
            await self._give_way()
        why = None
        if self.taken:
            why = "it is being taken over already"
        elif request.get("secret") != self._fingerprint:
            why = "another secret"
        else:
            why = self._busy()
        if why is not None:
            writer.write(orjson.dumps({"error": why}))
            writer.close()
            return
        self.taken = True  # refuses a second one while this one is answered
        try:
            pid = await self._pass_socket(reader, writer)
        except (OSError, TimeoutError, ValueError) as exc:
            self.taken = False
            writer.close()
            log.warning(
                "a take-over did not happen: the new gym-proxy went before it had the port "
                "(%s); serving on",
                exc or type(exc).__name__,
            )
            return
        self._successor = writer
        self._on_taken(pid)

    async def _pass_socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        """Send the listening socket and wait until the new instance says it has it; its
        pid. OSError, TimeoutError or ValueError when it went away first (nothing changed
        here: this instance still serves)."""
        transport_socket = writer.get_extra_info("socket")
        peer = socket.socket(fileno=os.dup(transport_socket.fileno()))
        try:  # one small message on a new connection: it fits the socket's buffer
            socket.send_fds(peer, [orjson.dumps({"ok": True})], [self._listen_sock.fileno()])
            pid = peer_of(peer).pid
        finally:
            peer.close()
        line = await asyncio.wait_for(reader.readline(), TOOK_WAIT)
        if not line:
            raise ConnectionError("it closed the connection")
        answer = orjson.loads(line)
        if not isinstance(answer, dict) or answer.get("took") is not True:
            raise ValueError(f"it answered {line[:80]!r}")
        return pid

    def released(self) -> None:
        """The runtime directory is free: the successor may take it now."""
        successor, self._successor = self._successor, None
        if successor is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                successor.write(orjson.dumps({"released": True}) + b"\n")
            successor.close()

    async def close(self) -> None:
        self.released()  # the directory goes with this process in any case
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
