"""The coordinator's end of the worker channels: accepts worker connections on its Unix
socket, one channel per registered worker.

A connection must open with `register` (`coordinator.contract.messages.Register`); the
registrar (the proxy's supervisor, with the checkpointer) accepts or refuses it and
supplies the reply (the pending claims and retire marks, an open checkpoint). From then on
the channel stays open for coordinator requests; when it ends, the registrar hears that
the owner is lost.

Only workers the supervisor started connect here, but the socket must not let anything
else take the proxy's descriptors: with a `limit` (the workers the supervisor has, plus
a margin: proxy.descriptor_budget), a connection over it first makes room by closing the
oldest connection that has not registered yet (a worker registers at once), and is
itself closed when every one has. A connection that does not register within
REGISTER_TIMEOUT is closed too, and so is one whose `register` the kernel contradicts:
its sender runs as another user, or is not the pid it names (`SO_PEERCRED`), since that
pid is what the supervisor watches and signals. Dropped connections are logged at most
every LOG_EVERY seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.framing import STREAM_LIMIT, FramingError, read_frame
from gym_proxy.coordinator.contract.messages import (
    MalformedMessage,
    Message,
    Register,
    RegisterReply,
)
from gym_proxy.coordinator.contract.trust import Untrusted, own_peer

__all__ = ["WorkerChannels", "RegistrationRefused"]

log = logging.getLogger("gym_proxy.coordinator")

REGISTER_TIMEOUT = 10.0
LET_GO_WAIT = 5.0  # seconds the channels' connections get to end after they close
LOG_EVERY = 10.0  # seconds between log lines about dropped connections


class RegistrationRefused(Exception):
    """The registrar does not expect this worker (wrong slot, owner or state)."""


Registrar = Callable[[Register, Channel], RegisterReply]
MessageHandler = Callable[[str, Message], Awaitable[Message | None]]


class WorkerChannels:
    """Holds one channel per registered worker owner."""

    def __init__(
        self,
        on_register: Registrar,
        on_lost: Callable[[str], None],
        on_message: MessageHandler,
        limit: Callable[[], int] | None = None,
    ) -> None:
        self._on_register = on_register
        self._on_lost = on_lost
        self._on_message = on_message
        self._limit = limit
        self.channels: dict[str, Channel] = {}
        self.dropped = 0  # connections closed before they registered
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._unregistered: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self._quiet_until = 0.0
        self._quiet_drops = 0

    async def start(self, socket_path: str) -> None:
        """Listen on `socket_path` (inside the 0700 runtime directory)."""
        self._server = await asyncio.start_unix_server(self.accept, socket_path, limit=STREAM_LIMIT)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one worker connection from the socket until it ends."""
        await self._serve(reader, writer, dialed=False)

    async def accept_dialed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one channel the proxy dialed to a placed worker
        (`proxy.ray_cluster.remote_workers`) until it ends. It proved the link key; the
        kernel's word on its pid would be its host's, which listened for it."""
        await self._serve(reader, writer, dialed=True)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dialed: bool
    ) -> None:
        if self._limit is not None and len(self._connections) >= self._limit():
            if not self._unregistered:
                self._drop(writer, "over the cap, and every connection registered")
                return
            oldest = next(iter(self._unregistered))
            del self._unregistered[oldest]
            oldest.transport.abort()  # its task reads the end and drops it
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._unregistered[writer] = None
        try:
            await self._run_connection(reader, writer, dialed)
        finally:
            self._connections.discard(task)
            self._unregistered.pop(writer, None)

    def _drop(self, writer: asyncio.StreamWriter, why: str) -> None:
        """Close a connection that did not register; log it unless a flood is on."""
        writer.close()
        self.dropped += 1
        now = time.monotonic()
        if now < self._quiet_until:
            self._quiet_drops += 1
            return
        more = f" (and {self._quiet_drops} more since the last)" if self._quiet_drops else ""
        log.error("coordinator connection dropped before registering: %s%s", why, more)
        self._quiet_until = now + LOG_EVERY
        self._quiet_drops = 0

    async def _run_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dialed: bool
    ) -> None:
        try:
            first = await asyncio.wait_for(read_frame(reader), REGISTER_TIMEOUT)
        except (FramingError, TimeoutError, ConnectionError) as exc:
            self._drop(writer, str(exc) or type(exc).__name__)
            return
        if first is None or first["type"] != Register.TYPE or not isinstance(first.get("id"), int):
            self._drop(writer, "it did not open with register")
            return
        try:
            registration = Register.decode(first)
            if not dialed:
                _check_claim(writer, registration)
        except (MalformedMessage, Untrusted) as exc:
            self._drop(writer, str(exc))
            return
        self._unregistered.pop(writer, None)
        owner = registration.owner

        async def handle(message: Message) -> Message | None:
            return await self._on_message(owner, message)

        channel = Channel(reader, writer, handle)
        try:
            reply = self._on_register(registration, channel)
        except RegistrationRefused as exc:
            log.error("registration refused: %s", exc)
            with contextlib.suppress(ConnectionError):
                refusal = {"type": "error", "code": "invalid_request", "detail": str(exc)}
                await channel.send({**refusal, "id": first["id"]})
            channel.close()
            return
        self.channels[owner] = channel
        try:
            await channel.send({"type": "ok", "id": first["id"], **reply.fields()})
            await channel.serve()
        except ConnectionError:
            pass
        finally:
            channel.close()
            if self.channels.get(owner) is channel:
                del self.channels[owner]
            self._on_lost(owner)

    async def let_go(self) -> None:
        """Stop listening and close every channel, the workers left running (a new
        gym-proxy takes them over): each connection ends as its channel closes."""
        if self._server is not None:
            self._server.close()
        for channel in list(self.channels.values()):
            channel.close()
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=LET_GO_WAIT)
        await self.close()

    async def close(self) -> None:
        """Stop listening and close every worker channel."""
        if self._server is not None:
            self._server.close()
        for channel in list(self.channels.values()):
            channel.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def _check_claim(writer: asyncio.StreamWriter, registration: Register) -> None:
    """Untrusted unless the process at the other end of a connection to the socket runs
    as this user and is the pid the registration names (the kernel's word,
    `SO_PEERCRED`): a pid is adopted, watched and signalled on this claim."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        raise Untrusted("a registration came on a connection that is not a Unix socket's")
    peer = own_peer(sock, "the coordinator socket")
    if peer.pid != registration.pid:
        raise Untrusted(f"a registration claims pid {registration.pid}, but pid {peer.pid} sent it")
