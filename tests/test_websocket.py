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
async def test_websocket_reaches_the_worker_that_holds_the_session(in_process, http, test_app):
    proxy = await in_process(workers=2, app=test_app)
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
    in_process, http, test_app
):
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=test_app)
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
async def test_an_idle_tunnel_is_closed_after_the_tunnel_idle_timeout(
    in_process, http, side, test_app
):
    proxy = await in_process("--tunnel-idle-timeout", "1", workers=1, app=test_app)
    token, _ = await seed(http, proxy.url)
    async with http.ws_connect(
        f"{proxy.url}/ws", headers={TOKEN: token}, autoping=False, heartbeat=None
    ) as ws:
        message = await ws.receive(timeout=15)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)


async def move_session(http: aiohttp.ClientSession, url: str, token: str, to_slot: int, **body):
    async with http.get(f"{url}/whoami", headers={TOKEN: token}) as resp:
        session_id = (await resp.json())["session_id"]
    payload = {"session_ids": [session_id], "to_slot": to_slot, **body}
    headers = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    async with http.post(
        f"{url}/ng-control/v1/gym-proxy/sessions/move", json=payload, headers=headers
    ) as resp:
        assert resp.status == 200
        return await resp.json()


async def slot_of(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.get(f"{url}/whoami", headers={TOKEN: token}) as resp:
        return (await resp.json())["slot"]


@BOTH_APP_KINDS
async def test_a_moving_session_s_tunnel_is_closed_and_the_reconnect_reaches_the_target(
    in_process, http, test_app
):
    """tunnels="close": a move closes the session's WebSocket with 1012, moves the
    session, and the client's reconnect reaches the target worker."""
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=test_app)
    token, _ = await seed(http, proxy.url)
    source = await slot_of(http, proxy.url, token)
    ws = await http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token})
    await ws.send_str("before")
    assert (await ws.receive_json(timeout=10))["echo"] == "before"
    moving = asyncio.ensure_future(move_session(http, proxy.url, token, 1 - source))
    closed = await ws.receive(timeout=10)
    assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, 1012)
    await ws.close()
    reply = await asyncio.wait_for(moving, 30)
    assert reply["failed"] == [] and len(reply["moved"]) == 1, reply
    async with http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token}) as again:
        await again.send_str("after")
        assert (await again.receive_json(timeout=10))["echo"] == "after"
    assert await slot_of(http, proxy.url, token) == 1 - source


async def test_a_blocking_tunnel_is_waited_for_and_then_reported(start_proxy, http):
    """tunnels="block": the move waits for the tunnel up to its timeout, leaves it open
    and reports the session; the session stays where it was."""
    proxy = start_proxy(workers=2, control_token=CONTROL_TOKEN, env={"GYM_TEST_TUNNELS": "block"})
    token, _ = await seed(http, proxy.url)
    source = await slot_of(http, proxy.url, token)
    async with http.ws_connect(f"{proxy.url}/ws", headers={TOKEN: token}) as ws:
        await ws.send_str("hi")
        assert (await ws.receive_json(timeout=10))["echo"] == "hi"
        reply = await move_session(http, proxy.url, token, 1 - source, timeout_s=0.5)
        assert reply["moved"] == [] and "still running" in reply["failed"][0]["reason"], reply
        await ws.send_str("still open")
        assert (await ws.receive_json(timeout=10))["echo"] == "still open"
    assert await slot_of(http, proxy.url, token) == source
