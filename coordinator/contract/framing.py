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

A message may carry bytes that are not JSON (a worker's checkpoint records, already
encoded as JSON lines, which the coordinator writes to disk untouched): its `blob` key
holds them in memory. On the wire the object says `"blob": <length>` and one more
frame follows, of exactly that length, holding the raw bytes. Encoding megabytes of
records once, in the worker, instead of as nested JSON that the coordinator parses and
encodes again, is most of a commit's time saved.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

__all__ = [
    "MAX_FRAME",
    "STREAM_LIMIT",
    "FramingError",
    "FrameTooLarge",
    "TruncatedFrame",
    "MalformedFrame",
    "encode_frame",
    "encode_frame_parts",
    "decode_payload",
    "read_frame",
]

MAX_FRAME = 1 << 30
# What a channel's StreamReader buffers before it stops reading: asyncio's default (64 KiB)
# pauses and resumes the socket every 128 KiB, about 60 loop turns for a restore's 8 MB
# install; this many bytes of a large frame arrive in a few.
STREAM_LIMIT = 1 << 22
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
    """Serialise one message into a frame (length prefix included), and its blob frame."""
    return b"".join(encode_frame_parts(message))


def encode_frame_parts(message: dict[str, Any]) -> list[bytes | bytearray | memoryview]:
    """encode_frame's bytes in pieces, for a writer's `writelines`: a blob of megabytes
    (a restore's records) is written as it is, not copied into one frame first."""
    blob = message.get("blob")
    if isinstance(blob, bytes | bytearray | memoryview):
        message = {**message, "blob": len(blob)}
    else:
        blob = None
    payload = orjson.dumps(message)
    for part in (payload, blob or b""):
        if len(part) > MAX_FRAME:
            raise FrameTooLarge(f"frame of {len(part)} bytes exceeds {MAX_FRAME}")
    if blob is None:
        return [_HEADER.pack(len(payload)) + payload]
    return [_HEADER.pack(len(payload)) + payload + _HEADER.pack(len(blob)), blob]


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
    message = decode_payload(await _read_payload(reader, header, limit))
    announced = message.get("blob")
    if announced is None:
        return message
    if type(announced) is not int or announced < 0:
        raise MalformedFrame("'blob' must announce a length")
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame("stream ended before an announced blob") from exc
    if _HEADER.unpack(header)[0] != announced:
        raise MalformedFrame(f"the blob frame is not the announced {announced} bytes")
    message["blob"] = await _read_payload(reader, header, limit)
    return message


async def _read_payload(reader: asyncio.StreamReader, header: bytes, limit: int) -> bytes:
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise FrameTooLarge(f"frame announces {length} bytes, limit is {limit}")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame(
            f"stream ended after {len(exc.partial)} of {length} payload bytes"
        ) from exc
