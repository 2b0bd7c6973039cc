"""Writes to a transport, coalesced while one read is being handled.

Handling one read from a client or a worker usually produces several writes to the
other side: a response head and its body, a request head and its body. Each
`transport.write` is a system call, and they were most of the proxy's CPU. So every
write goes through an `Outbox`: while a read is being handled (between `hold()` and
`release()`, nestable), writes are queued per outbox and sent as one write when the
outermost handler returns. Outside a read they are sent at once. Order within one
transport is kept; closing or half-closing a transport sends what is queued first.
"""

from __future__ import annotations

import asyncio

__all__ = ["Outbox", "batch", "hold", "release"]

_depth = 0
_batch = 0  # which read is being handled (or was last): writes in one batch go together
_dirty: list[Outbox] = []


def hold() -> None:
    """A read is being handled: queue writes until the matching `release`."""
    global _depth, _batch
    if not _depth:
        _batch += 1
    _depth += 1


def batch() -> int:
    """The current batch: a write made in a later batch is a separate write."""
    return _batch


def release() -> None:
    """The read is handled: send every queued write (one write per transport)."""
    global _depth
    _depth -= 1
    if _depth == 0 and _dirty:
        dirty = _dirty[:]
        _dirty.clear()
        for outbox in dirty:
            outbox.flush()


class Outbox:
    """The write side of one transport."""

    __slots__ = ("transport", "pending", "closed")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.pending: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if _depth:
            if not self.pending:
                _dirty.append(self)
            self.pending.append(data)
        else:
            self.transport.write(data)

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.write(part)

    def flush(self) -> None:
        pending = self.pending
        if pending and not self.closed:
            self.pending = []
            self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        """Send what is queued, then close after the transport's buffer drains."""
        if not self.closed:
            self.flush()
            self.closed = True
            self.transport.close()

    def write_eof(self) -> None:
        """Send what is queued, then half-close (the transport keeps reading)."""
        if not self.closed:
            self.flush()
            self.closed = True
            self.transport.write_eof()

    def abort(self) -> None:
        """Drop what is queued and cut the connection now (also after a half-close)."""
        self.closed = True
        self.pending = []
        self.transport.abort()
