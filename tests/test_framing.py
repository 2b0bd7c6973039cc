"""Unit tests of the coordinator framing and of request/reply over a real socket pair."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import orjson
import pytest

from gym_proxy.coordinator.contract.channel import Channel, ChannelClosed, RemoteError
from gym_proxy.coordinator.contract.framing import (
    MAX_FRAME,
    FrameTooLarge,
    MalformedFrame,
    TruncatedFrame,
    encode_frame,
    read_frame,
)
from gym_proxy.coordinator.contract.messages import Done, Message, Ping, Pong, Request, message

pytestmark = pytest.mark.fast

# The channel's tests speak messages of their own (the channel is generic over them).
TEST_MESSAGES: dict[str, type[Message]] = {}


@message(registry=TEST_MESSAGES)
class Echoed(Message):
    echo: int


@message("echo", registry=TEST_MESSAGES)
class Echo(Request[Echoed]):
    value: int


@message("boom", registry=TEST_MESSAGES)
class Boom(Request[Done]):
    pass


@message(registry=TEST_MESSAGES)
class Handled(Message):
    done: str


@message("stall", registry=TEST_MESSAGES)
class Stall(Request[Handled]):
    pass


@message("after", registry=TEST_MESSAGES)
class After(Request[Handled]):
    pass


@message("wrong_reply", registry=TEST_MESSAGES)
class WrongReply(Request[Echoed]):
    pass


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_round_trip_and_clean_eof():
    reader = reader_with(encode_frame({"type": "a", "id": 1}) + encode_frame({"type": "b"}))
    assert await read_frame(reader) == {"type": "a", "id": 1}
    assert await read_frame(reader) == {"type": "b"}
    assert await read_frame(reader) is None


async def test_oversized_length_refused_before_reading_payload():
    reader = reader_with(struct.pack(">I", MAX_FRAME + 1), eof=False)
    with pytest.raises(FrameTooLarge):
        await read_frame(reader)


async def test_truncated_header_and_payload():
    with pytest.raises(TruncatedFrame):
        await read_frame(reader_with(b"\x00\x00"))
    frame = encode_frame({"type": "x", "pad": "y" * 100})
    with pytest.raises(TruncatedFrame):
        await read_frame(reader_with(frame[:-10]))


async def test_blob_travels_as_its_own_frame():
    blob = b'{"a":1}\n' * 1000
    frame = encode_frame({"type": "ok", "id": 3, "blob": blob})
    assert orjson.loads(frame[4 : 4 + struct.unpack(">I", frame[:4])[0]])["blob"] == len(blob)
    reader = reader_with(frame + encode_frame({"type": "next"}))
    assert await read_frame(reader) == {"type": "ok", "id": 3, "blob": blob}
    assert await read_frame(reader) == {"type": "next"}


@pytest.mark.parametrize(
    "tail, error",
    [
        (struct.pack(">I", 4) + b"abcd", MalformedFrame),  # not the announced length
        (struct.pack(">I", 5) + b"ab", TruncatedFrame),
        (b"", TruncatedFrame),
    ],
)
async def test_blob_frame_must_match_its_announcement(tail, error):
    payload = b'{"type": "ok", "blob": 5}'
    with pytest.raises(error):
        await read_frame(reader_with(struct.pack(">I", len(payload)) + payload + tail))


@pytest.mark.parametrize("payload", [b'{"type": "ok", "blob": -1}', b'{"type": "ok", "blob": "x"}'])
async def test_blob_announcement_must_be_a_length(payload):
    with pytest.raises(MalformedFrame):
        await read_frame(reader_with(struct.pack(">I", len(payload)) + payload))


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'{"id": 1}', b'{"type": 5}'])
async def test_garbage_payload(payload):
    with pytest.raises(MalformedFrame):
        await read_frame(reader_with(struct.pack(">I", len(payload)) + payload))


async def _pair(handler_a, handler_b):
    left, right = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=left)
    rb, wb = await asyncio.open_connection(sock=right)
    a = Channel(ra, wa, handler_a, TEST_MESSAGES)
    b = Channel(rb, wb, handler_b, TEST_MESSAGES)
    tasks = [asyncio.create_task(a.serve()), asyncio.create_task(b.serve())]
    return a, b, tasks


async def test_request_reply_by_id_and_errors():
    async def echo(message):
        if isinstance(message, Boom):
            raise ValueError("no such thing")
        if isinstance(message, WrongReply):
            return Handled("not an echo")
        return Echoed(message.value)

    async def none(message):
        return None

    a, b, tasks = await _pair(none, echo)
    replies = await asyncio.gather(*(a.request(Echo(i)) for i in range(50)))
    assert [r.echo for r in replies] == list(range(50))
    with pytest.raises(RemoteError, match="no such thing"):
        await a.request(Boom())
    malformed = r"malformed reply to wrong_reply: Echoed: unknown key\(s\) done"
    with pytest.raises(RemoteError, match=malformed):
        await a.request(WrongReply())
    b.close()
    await asyncio.gather(*tasks)
    with pytest.raises(ChannelClosed):
        await a.request(Echo(1))


async def test_a_malformed_request_is_refused_naming_the_message_and_key():
    """A missing, unknown or mistyped key never reaches the handler."""
    seen = []

    async def echo(message):
        seen.append(message)
        return Echoed(message.value)

    async def none(message):
        return None

    a, b, tasks = await _pair(none, echo)
    cases: list[tuple[dict[str, object], str]] = [
        ({"type": "echo"}, "echo: missing key(s) value"),
        ({"type": "echo", "value": 1, "extra": 2}, "echo: unknown key(s) extra"),
        ({"type": "echo", "value": "1"}, "echo: value is not a int"),
        ({"type": "nothing"}, "unknown message type 'nothing'"),
    ]
    for number, (payload, detail) in enumerate(cases, 1000):
        future = asyncio.get_running_loop().create_future()
        a._pending[number] = future
        a.send_nowait({**payload, "id": number})
        reply = await asyncio.wait_for(future, 5)
        assert (reply["type"], reply["code"], reply["detail"]) == (
            "error",
            "invalid_request",
            detail,
        )
    assert seen == []
    assert (await a.request(Echo(7))).echo == 7
    b.close()
    await asyncio.gather(*tasks)


async def test_pending_request_fails_when_peer_closes():
    gate = asyncio.Event()

    async def stall(message):
        await gate.wait()

    async def none(message):
        return None

    a, b, tasks = await _pair(none, stall)
    pending = asyncio.create_task(a.request(Stall()))
    await asyncio.sleep(0)
    b.close()
    with pytest.raises(ChannelClosed):
        await pending
    gate.set()
    await asyncio.gather(*tasks)


async def test_garbage_from_peer_drops_the_channel():
    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=left)

    async def none(message):
        return None

    channel = Channel(reader, writer, none, TEST_MESSAGES)
    task = asyncio.create_task(channel.serve())
    right.sendall(struct.pack(">I", 5) + b"hello")
    await asyncio.wait_for(task, 5)
    assert channel.closed
    right.close()
    assert orjson.loads(encode_frame({"type": "t"})[4:]) == {"type": "t"}


async def test_typed_errors_cross_the_channel():
    from gym_proxy.coordinator.contract.errors import GymError

    async def refuse(message):
        raise GymError("checkpoint_parked", "come back later")

    async def none(message):
        return None

    a, b, tasks = await _pair(none, refuse)
    with pytest.raises(RemoteError) as err:
        await a.request(Boom())
    assert (err.value.code, err.value.detail) == ("checkpoint_parked", "come back later")
    assert err.value.status == 409 and isinstance(err.value, GymError)
    b.close()
    await asyncio.gather(*tasks)


async def test_request_deadline_and_pings_while_a_handler_is_stuck():
    from gym_proxy.coordinator.contract.channel import ChannelTimeout

    gate, entered = asyncio.Event(), asyncio.Event()
    handled = []

    async def slow_then_record(message):
        if isinstance(message, Stall):
            entered.set()
            await gate.wait()
        handled.append(message.TYPE)
        return Handled(message.TYPE)

    async def none(message):
        return None

    a, b, tasks = await _pair(none, slow_then_record)
    stalled = asyncio.ensure_future(a.request(Stall()))
    await asyncio.wait_for(entered.wait(), 5)
    with pytest.raises(ChannelTimeout):
        await a.request(After(), within=0.2)  # queued behind the stuck handler
    # the peer's reader still answers pings: its event loop runs
    assert await a.request(Ping(), within=1.0) == Pong(0.0)
    b.pong = lambda: Pong(1.5, 2**26)  # a peer that measures itself says so, when asked only
    assert await a.request(Ping(loop_lag=True), within=1.0) == Pong(1.5, 2**26)
    assert await a.request(Ping(), within=1.0) == Pong(0.0)
    gate.set()
    assert (await stalled).done == "stall"
    assert handled == ["stall", "after"]  # in arrival order; the late reply was dropped
    a.close()
    b.close()
    await asyncio.gather(*tasks)


def test_a_pong_without_memory_is_an_older_worker_s_and_reads_as_unknown():
    """A worker of an earlier version (one a take-over successor adopts) answers without
    `resident_bytes`: read as 0, what the proxy takes for "not said"."""
    assert Pong.decode({"type": "ok", "id": 1, "loop_lag_seconds": 0.2}) == Pong(0.2, 0)


def test_a_process_reads_its_own_resident_memory():
    from gym_proxy.coordinator.contract.process_memory import resident_bytes

    mine = resident_bytes()
    assert mine > 2**20 and abs(resident_bytes(os.getpid()) - mine) < 2**24
    assert resident_bytes(2**22 + 1) == 0  # no such process: unknown
