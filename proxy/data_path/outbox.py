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
from typing import Final

from gym_proxy.proxy.data_path import read_buffer

__all__ = ["Outbox", "batch", "hold", "release"]


class _Reads:
    """The read being handled: how deep the handlers nest, which batch it is, and the
    outboxes with writes queued. One object, not module globals: compiled (setup.py),
    an attribute is a field of a C struct, where a global is a dict lookup."""

    __slots__ = ("depth", "batch", "dirty")

    def __init__(self) -> None:
        self.depth = 0
        self.batch = 0  # which read is being handled (or was last): its writes go together
        self.dirty: list[Outbox] = []


_READS: Final = _Reads()


def hold() -> None:
    """A read is being handled: queue writes until the matching `release`."""
    reads = _READS
    if not reads.depth:
        reads.batch += 1
    reads.depth += 1


def batch() -> int:
    """The current batch: a write made in a later batch is a separate write."""
    return _READS.batch


def release() -> None:
    """The read is handled: send every queued write (one write per transport)."""
    reads = _READS
    reads.depth -= 1
    if reads.depth == 0 and reads.dirty:
        dirty = reads.dirty
        reads.dirty = []
        for outbox in dirty:
            outbox.flush()


# Queued writes up to this size are joined into one buffer; larger ones go out as they
# are, in one writev (`writelines`): joining would copy every byte of a large body once
# more (a 64 KiB POST: 64k instructions, a third of the proxy's cost for it).
JOIN_AT_MOST: Final = 16384


class Outbox:
    """The write side of one transport.

    A write may be a view of the shared read buffer (read_buffer): should the transport
    keep it, unsent, past the write, the buffer is lent (`read_buffer.READ.lend`)."""

    __slots__ = ("transport", "pending", "queued", "closed", "views")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.pending: list[bytes | memoryview] = []
        self.queued = 0  # bytes in `pending`
        self.closed = False
        self.views = False  # `pending` holds a view of the read buffer

    def write(self, data: bytes | memoryview) -> None:
        if self.closed or not data:
            return
        if _READS.depth:
            if not self.pending:
                _READS.dirty.append(self)
            self.pending.append(data)
            self.queued += len(data)
            if not isinstance(data, bytes):
                self.views = True
        else:
            self.transport.write(data)
            if not isinstance(data, bytes):
                self._lend_if_kept()

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        for part in parts:
            self.write(part)

    def _lend_if_kept(self) -> None:
        """A view went to the transport: if it kept any of it, the buffer is not ours."""
        self.views = False
        if self.transport.get_write_buffer_size():
            read_buffer.READ.lend()

    def flush(self) -> None:
        pending = self.pending
        if pending and not self.closed:
            self.pending = []
            if len(pending) == 1:
                self.transport.write(pending[0])
            elif self.queued <= JOIN_AT_MOST:
                first = pending[0]
                second = pending[1]
                if len(pending) == 2 and isinstance(first, bytes) and isinstance(second, bytes):
                    # A head and its body, mostly: a concatenation is one copy, where a
                    # join takes a buffer of every part (~400 instructions each).
                    self.transport.write(first + second)
                else:
                    self.transport.write(b"".join(pending))
                self.views = False  # joined: a copy
            else:
                self.transport.writelines(pending)
            self.queued = 0
            if self.views:
                self._lend_if_kept()

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
        self.queued = 0
        self.views = False
        self.transport.abort()
