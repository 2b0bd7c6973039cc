"""The memory every client read lands in: one buffer, shared, replaced when it is lent.

Handed bytes (`data_received`), the proxy paid for each read twice before its own code
ran: uvloop copies the read into a new bytes object, and llhttp's body callback copies
the body into another. A 64 KiB body cost 130k instructions in copies alone, two thirds
of its request. As a `BufferedProtocol` a client connection is handed this buffer to
read into instead, and a large body's bytes go on as views of it (client_connection).

One buffer serves every connection: the loop handles one read at a time, and what a
read causes is written before it returns (outbox). A view may outlive its read in one
place only, a transport's write buffer (a peer that does not take the bytes at once):
the outbox then calls `lend`, and later reads go to a new buffer while the old one
lives as long as its views. Whatever else keeps input past its read keeps a copy.
"""

from __future__ import annotations

from typing import Final

__all__ = ["READ", "ReadBuffer", "SIZE"]

SIZE: Final = 262144  # uvloop reads this much at most into its own buffer too


class ReadBuffer:
    """The buffer reads go to now (`data`) and a view of all of it (`view`)."""

    __slots__ = ("data", "view", "lent")

    def __init__(self) -> None:
        self.data = bytearray(SIZE)
        self.view = memoryview(self.data)
        self.lent = 0  # buffers given up to transports so far (tests and curiosity)

    def lend(self) -> None:
        """A transport keeps a view of this buffer: later reads go to a new one."""
        self.data = bytearray(SIZE)
        self.view = memoryview(self.data)
        self.lent += 1


READ: Final = ReadBuffer()
