"""Wire format of the coordinator channel.

One frame is a 4-byte big-endian unsigned length followed by exactly that many bytes
holding one orjson document (a JSON object)::

    +----------------+------------------------------+
    | length (u32 BE) | JSON object, `length` bytes |
    +----------------+------------------------------+

A length above `MAX_FRAME` (1 GiB) can only come from a corrupt or hostile stream, so the
reader refuses it before reading the payload and the connection is dropped. End of stream
exactly between two frames is a clean close (`read_frame` returns None); end of stream
inside a frame is a `TruncatedFrame`.

Every message is an object with a string `type`. Requests carry an integer `id`; the
reply carries the same `id` and has `type` "ok" or "error" (with `message`).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

__all__ = [
    "MAX_FRAME",
    "FramingError",
    "FrameTooLarge",
    "TruncatedFrame",
    "MalformedFrame",
    "encode_frame",
    "decode_payload",
    "read_frame",
]

MAX_FRAME = 1 << 30
_HEADER = struct.Struct(">I")


class FramingError(Exception):
    """The byte stream is not a valid sequence of frames; drop the connection."""


class FrameTooLarge(FramingError):
    """A frame announced a length above MAX_FRAME."""


class TruncatedFrame(FramingError):
    """The stream ended inside a frame."""


class MalformedFrame(FramingError):
    """The payload is not a JSON object with a string `type`."""


def encode_frame(message: dict[str, Any]) -> bytes:
    """Serialise one message into a frame (length prefix included)."""
    payload = orjson.dumps(message)
    if len(payload) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Parse a frame's payload; raise MalformedFrame unless it is an object with a type."""
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise MalformedFrame(f"payload is not JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise MalformedFrame("payload is not an object with a string 'type'")
    return message


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> dict[str, Any] | None:
    """Read one message; None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise TruncatedFrame("stream ended inside a frame header") from exc
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise FrameTooLarge(f"frame announces {length} bytes, limit is {limit}")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame(
            f"stream ended after {len(exc.partial)} of {length} payload bytes"
        ) from exc
    return decode_payload(payload)
