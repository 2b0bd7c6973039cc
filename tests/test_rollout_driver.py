"""The rollout driver against a server on a real socket: a rollout counts as finished
only once a 200 and its whole reply arrived."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from gym_proxy.coordinator.clients.rollouts import Rollout, RolloutDriver

pytestmark = pytest.mark.fast

REPLY = orjson.dumps({"reward": 1.0})


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request per connection; the rollout ID says how to answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    rollout_id = orjson.loads(await reader.readexactly(length))["_ng_rollout_id"]
    if rollout_id == "busy":
        body = b'{"error": {"code": "checkpoint_parked"}}'
        writer.write(b"HTTP/1.1 409 Conflict\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    elif rollout_id == "cut":  # the head and part of the reply, then the server is gone
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + REPLY[:5])
    else:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(REPLY), REPLY))
    await writer.drain()
    writer.close()


async def test_only_a_whole_200_reply_finishes_a_rollout():
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rollouts = [Rollout(name, {"task": name}) for name in ("ok", "cut", "busy")]
    connector = aiohttp.TCPConnector(force_close=True)
    async with server, aiohttp.ClientSession(connector=connector) as http:
        await RolloutDriver(f"http://127.0.0.1:{port}", http).run(rollouts)
    ok, cut, busy = rollouts
    assert ok.finished and ok.reply == {"reward": 1.0} and ok.history == [(0, 200, None)]
    assert not cut.finished and cut.status == 200 and cut.error is not None
    assert not busy.finished and busy.history == [(0, 409, None)]
    assert RolloutDriver.continue_after_restore(rollouts, {"cut"}) == ["busy"]
    assert (ok.attempt, cut.attempt, busy.attempt) == (0, 1, 1)
