"""One JSON object a line: the small protocols between gym-proxy's processes other than
the worker channel (the take-over's messages: `proxy.take_over.TAKE_OVER`; the zygote's:
`coordinator.contract.zygote_lines`; the Ray head holder's and the placement driver's:
`proxy.ray_cluster.lines`).

Each line is a declared message (`coordinator.contract.messages.Message`, registered in
its protocol's own table) with its wire `type`, decoded as strictly as the channel's: a
line that is not JSON, names no type or one its protocol does not have, or has an
unknown, missing or mistyped key is refused with `LineError`, whose message names the
peer and what is wrong in one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol, TypeVar, overload, runtime_checkable

import orjson

from gym_proxy.coordinator.contract.messages import MalformedMessage, Message

__all__ = ["LineError", "encode_line", "decode_line", "expect", "greeting"]

M = TypeVar("M", bound=Message)
M2 = TypeVar("M2", bound=Message)
M3 = TypeVar("M3", bound=Message)
MAX_LINE = 1 << 20  # bytes: a line is a few fields (a zygote's environment the largest)


class LineError(ValueError):
    """A line a peer sent that is not a message of its protocol (the message says which
    peer, and what is wrong)."""


def encode_line(message: Message) -> bytes:
    """`message` as one line: its wire object, then a newline."""
    return orjson.dumps(message.wire()) + b"\n"


def decode_line(line: bytes, protocol: Mapping[str, type[Message]], peer: str) -> Message:
    """The message `line` holds, one of `protocol`'s; LineError naming `peer` otherwise
    (an empty line is the peer's end: it closed the connection)."""
    if not line:
        raise LineError(f"{peer} closed the connection")
    if len(line) > MAX_LINE:
        raise LineError(f"{peer} sent a line of {len(line)} bytes, over {MAX_LINE}")
    try:
        wire = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise LineError(f"{peer} sent a line that is not JSON: {line[:60]!r}") from None
    kind = wire.get("type") if isinstance(wire, dict) else None
    if not isinstance(kind, str):
        raise LineError(f"{peer} sent a line with no message type: {line[:60]!r}")
    definition = protocol.get(kind)
    if definition is None:
        raise LineError(f"{peer} sent a {kind!r} message, which this protocol does not have")
    try:
        message = definition.decode(wire)
    except MalformedMessage as exc:
        raise LineError(f"{peer} sent a malformed message: {exc}") from None
    # The decode leaves the channel's envelope out (its `id`, `traceparent`); a line has none.
    unread = set(wire) - {"type"} - set(message.fields())
    if unread:
        keys = ", ".join(sorted(unread))
        raise LineError(f"{peer} sent a malformed message: {kind}: unknown key(s) {keys}")
    return message


# One overload per count of `wanted`: the message is then the union of what was wanted
# (mypy joins several `type[M]` arguments into their base, Message).
@overload
def expect(
    line: bytes, protocol: Mapping[str, type[Message]], peer: str, wanted: type[M], /
) -> M: ...


@overload
def expect(
    line: bytes, protocol: Mapping[str, type[Message]], peer: str, a: type[M], b: type[M2], /
) -> M | M2: ...


@overload
def expect(
    line: bytes,
    protocol: Mapping[str, type[Message]],
    peer: str,
    a: type[M],
    b: type[M2],
    c: type[M3],
    /,
) -> M | M2 | M3: ...


def expect(
    line: bytes, protocol: Mapping[str, type[Message]], peer: str, *wanted: type[Message]
) -> Message:
    """The message `line` holds, which must be one of `wanted` (LineError otherwise)."""
    message = decode_line(line, protocol, peer)
    if not isinstance(message, wanted):
        names = " or ".join(w.TYPE for w in wanted)
        raise LineError(f"{peer} sent {message.TYPE!r} where {names} was due")
    return message


@runtime_checkable
class _Failure(Protocol):
    error: str


async def greeting(
    stream: asyncio.StreamReader,
    within: float,
    protocol: Mapping[str, type[Message]],
    peer: str,
    ready: type[M],
    failed: type[Message],
) -> M | str:
    """The first line a helper process says (`ready`, or `failed` with why), as the
    message it is or why not: its `failed` error, a line it cannot read, or its end
    before it said anything. TimeoutError after `within` seconds."""
    line = await asyncio.wait_for(stream.readline(), within)
    if not line:
        return f"{peer} ended before it said anything (its log is above)"
    try:
        said = expect(line, protocol, peer, ready, failed)
    except LineError as exc:
        return str(exc)
    if isinstance(said, ready):
        return said
    return said.error if isinstance(said, _Failure) else f"{peer} said {said.TYPE!r}"
