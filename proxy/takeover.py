"""An upgrade: a new gym-proxy takes over a running one's listening socket and workers.

A running instance with `--orphan-grace` listens on `takeover.sock` in its runtime
directory (0700, so only its user reaches it). A new instance started with the same
command plus `--take-over` finds that directory (the one whose identity file names its
instance), asks for the listening socket with its secret's fingerprint, and receives the
socket's descriptor over the Unix socket (SCM_RIGHTS: how HAProxy's `-x` and Envoy's hot
restart pass listeners). The port never closes: the old instance stops accepting, and
connections that come before the new one serves wait in the socket's backlog. The old
instance then passes its workers on (they rejoin the new one as after a crash, see
`worker.process`), releases its runtime directory and says so on the same connection
(`{"released": true}`), which the new instance waits for before it takes the directory
(`until_released`: an event, not a poll of the directory's lock; the connection's end
does as well, should the old instance die first). Then the old one finishes its open
connections' requests (`proxy.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from gym_proxy.proxy.runtime_dir import PREFIX, read_identity

__all__ = [
    "TAKEOVER_NAME",
    "TakeOver",
    "TakeOverError",
    "TakeOverListener",
    "take_over_listener",
    "until_released",
]

TAKEOVER_NAME = "takeover.sock"
REQUEST_WAIT = 5.0  # seconds a connection gets to send its request
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
        conn.sendall(orjson.dumps({"secret": fingerprint}) + b"\n")
        message, fds, _, _ = socket.recv_fds(conn, 4096, 1)
    except OSError as exc:
        conn.close()
        raise TakeOverError(f"cannot take over the gym-proxy at {path}: {exc}") from None
    if not fds:
        conn.close()
        reason = orjson.loads(message).get("error", "no reason given") if message else "it closed"
        raise TakeOverError(f"the running gym-proxy of instance {instance} refused: {reason}")
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
                pass  # `{"released": true}`, then the end; the end is what counts
    except TimeoutError:
        return False
    except OSError:
        pass  # reset by a dying peer: as good as its end
    finally:
        conversation.close()
    return True


def _running(parent: str, instance: str) -> str:
    """The take-over socket of the running instance named `instance` under `parent`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            identity = read_identity(entry.path)
            path = os.path.join(entry.path, TAKEOVER_NAME)
            if identity is not None and identity.get("instance") == instance:
                if os.path.exists(path):
                    return path
    raise TakeOverError(
        f"no running gym-proxy of instance {instance} under {parent} to take over "
        "(it must run with the same secret and --runtime-dir, --orphan-grace not 0)"
    )


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
            line = await asyncio.wait_for(reader.readline(), REQUEST_WAIT)
            request = orjson.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except (TimeoutError, ValueError, orjson.JSONDecodeError, ConnectionError):
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
        self.taken = True
        transport_socket = writer.get_extra_info("socket")
        peer = socket.socket(fileno=os.dup(transport_socket.fileno()))
        try:  # one small message on a new connection: it fits the socket's buffer
            socket.send_fds(peer, [orjson.dumps({"ok": True})], [self._listen_sock.fileno()])
            pid = _peer_pid(peer)
        finally:
            peer.close()
        self._successor = writer
        self._on_taken(pid)

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


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end (SO_PEERCRED), for the log."""
    with contextlib.suppress(OSError):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return int.from_bytes(creds[:4], "little")
    return 0
