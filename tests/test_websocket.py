"""WebSocket tunnels through gym-proxy to the session's worker, real processes.

The forwarding machine's tunnel cases (held bytes, back-pressure, idle timeout, who
closes) are in test_data_path.py; this is what needs a real worker and a real client.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN, Control, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"


async def seed(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    """A new session: its token and the worker that holds it."""
    async with http.post(f"{url}/seed_session", json={"initial_count": 0}) as resp:
        token = resp.headers[TOKEN]
    async with http.get(f"{url}/whoami", headers={TOKEN: token}) as resp:
        return token, (await resp.json())["owner"]


@BOTH_APP_KINDS
async def test_websocket_reaches_the_worker_that_holds_the_session(start_proxy, http):
    proxy = start_proxy(workers=2)
    sessions = [await seed(http, proxy.url) for _ in range(4)]
    assert len({owner for _, owner in sessions}) == 2
    big = "x" * (1 << 20)  # more than any socket buffer: back-pressure both ways
    for token, owner in sessions:
        async with http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token}) as ws:
            for text in ("a", "b", big, "c"):
                await ws.send_str(text)
                reply = await ws.receive_json(timeout=10)
                assert (reply["owner"], reply["echo"]) == (owner, text)
            assert reply["session_id"]


@BOTH_APP_KINDS
async def test_a_checkpoint_closes_open_websockets_and_a_reconnect_waits_for_resume(
    start_proxy, http
):
    proxy = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    control = Control(http, proxy.url)
    token, owner = await seed(http, proxy.url)
    ws = await http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token})
    await ws.send_str("before")
    assert (await ws.receive_json(timeout=10))["echo"] == "before"
    await control.ok("prepare", checkpoint_id="ws-close")
    closed = await ws.receive(timeout=10)
    # 1012 "service restart": reconnect. (The client's own close_code may read 1006: the
    # worker does not wait for the client's closing handshake.)
    assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, 1012)
    await ws.close()

    async def prepared() -> bool:
        reply = await control.ok("prepare", checkpoint_id="ws-close")
        return reply["phase"] == "prepared"

    await wait_until(prepared, 15, "prepare to finish once the tunnel closed")

    async def reconnect() -> str:
        async with http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token}) as again:
            await again.send_str("after")
            reply = await again.receive_json(timeout=10)
            return f"{reply['owner']}:{reply['echo']}"

    waiting = asyncio.ensure_future(reconnect())
    await control.ok("resume", checkpoint_id="ws-close")
    assert await asyncio.wait_for(waiting, 15) == f"{owner}:after"


@BOTH_APP_KINDS
async def test_a_blocking_app_names_its_open_websocket_as_a_blocker(start_proxy, http):
    proxy = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_TUNNELS": "block"})
    control = Control(http, proxy.url)
    token, _ = await seed(http, proxy.url)
    ws = await http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token})
    await ws.send_str("hi")
    assert (await ws.receive_json(timeout=10))["echo"] == "hi"
    reply = await control.ok("prepare", checkpoint_id="ws-block", deadline_ts=Control.deadline(1))
    assert reply["phase"] == "preparing"
    assert any(b.startswith("tunnel:") for b in reply["report"]["blockers"]), reply
    await ws.send_str("still open")  # a blocking tunnel keeps working meanwhile
    assert (await ws.receive_json(timeout=10))["echo"] == "still open"
    await ws.close()

    async def prepared() -> bool:
        reply = await control.ok("prepare", checkpoint_id="ws-block")
        return reply["phase"] == "prepared"

    await wait_until(prepared, 15, "prepare to finish once the client closed")
    await control.ok("resume", checkpoint_id="ws-block")


@pytest.mark.parametrize("side", ["idle"])
async def test_an_idle_tunnel_is_closed_after_the_tunnel_idle_timeout(start_proxy, http, side):
    proxy = start_proxy("--tunnel-idle-timeout", "1", workers=1)
    token, _ = await seed(http, proxy.url)
    async with http.ws_connect(
        f"{proxy.url}/ws", headers={TOKEN: token}, autoping=False, heartbeat=None
    ) as ws:
        message = await ws.receive(timeout=15)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
