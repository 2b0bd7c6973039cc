"""A session ID alone never opens a session (issue: hardening round 3), with real processes.

The victim seeds a counter at 500. After each way a session comes to be placed by the
proxy's table instead of its token's owner (a rolling restart, a move, a drain, a restore
from a checkpoint), an attacker who knows only the victim's session ID (access logs print
it; the move call takes it) sends an unsigned app token or a Starlette-shaped app cookie
naming it. Neither reaches the victim's session: the victim's counter stays 500, and the
attacker's call is answered as a call of no session (the app's token: 404
`unknown_session`) or of a fresh one (the cookie)."""

from __future__ import annotations

import base64

import aiohttp
import orjson
import pytest

from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN as CONTROL
from tests.support import TEST_SECRET, Control, write_checkpoint

TOKEN = "X-NeMo-Gym-Session-Token"
AUTH = {"Authorization": f"Bearer {CONTROL}"}
WORKERS = "/ng-control/v1/gym-proxy/workers"


def forged_app_token(session_id: str) -> str:
    """NeMo Gym's MCP token shape naming `session_id`, with no secret and no MAC."""
    return base64.urlsafe_b64encode(orjson.dumps(session_id)).rstrip(b"=").decode() + ".AAAA"


def forged_app_cookie(session_id: str) -> str:
    """Starlette's session cookie shape naming `session_id`, with no valid signature."""
    payload = base64.b64encode(orjson.dumps({"session_id": session_id})).decode()
    return f"session={payload}.x.y"


async def call(http: aiohttp.ClientSession, url: str, path: str, headers: dict, **body) -> tuple:
    async with http.post(f"{url}{path}", json=body, headers=headers) as response:
        return response.status, await response.json()


async def seed_victim(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    async with http.post(f"{url}/seed_session", json={"initial_count": 500}) as response:
        assert response.status == 200 and (await response.json())["count"] == 500
        token = response.headers[TOKEN]
    return token, token.split(".")[2]  # v2.<instance>.<session>.<owner>.<mac>


async def attack(http: aiohttp.ClientSession, url: str, victim: str, session_id: str) -> None:
    """Both forgeries, then the victim's own count: still 500."""
    status, reply = await call(
        http, url, "/increment_counter", {TOKEN: forged_app_token(session_id)}, count=10**6
    )
    assert (status, reply["error"]["code"]) == (404, "unknown_session"), reply
    status, reply = await call(
        http, url, "/increment_counter", {"Cookie": forged_app_cookie(session_id)}, count=10**6
    )
    assert (status, reply["count"]) == (200, 10**6), reply  # a fresh session of its own
    status, reply = await call(http, url, "/get_counter_value", {TOKEN: victim})
    assert (status, reply["count"]) == (200, 500), reply


async def operate(http: aiohttp.ClientSession, url: str, name: str, **body) -> dict:
    async with http.post(f"{url}{WORKERS}/{name}", json=body, headers=AUTH) as response:
        reply = await response.json()
        assert response.status == 200 and reply["complete"], reply
        return reply


@BOTH_APP_KINDS
@pytest.mark.parametrize("operation", ["restart", "move", "drain"])
async def test_a_session_id_alone_does_not_open_a_placed_session(
    in_process, http, operation, test_app
):
    proxy = await in_process(workers=2, control_token=CONTROL, app=test_app)
    victim, session_id = await seed_victim(http, proxy.url)
    await attack(http, proxy.url, victim, session_id)  # before: routed by its owner
    if operation == "restart":
        await operate(http, proxy.url, "restart", pause_s=0)
    elif operation == "drain":
        async with http.get(f"{proxy.url}/whoami", headers={TOKEN: victim}) as response:
            slot = (await response.json())["slot"]
        await operate(http, proxy.url, "drain", slot=slot)
    else:
        async with http.get(f"{proxy.url}/whoami", headers={TOKEN: victim}) as response:
            slot = (await response.json())["slot"]
        body = {"session_ids": [session_id], "to_slot": 1 - slot}
        status, reply = await call(
            http, proxy.url, "/ng-control/v1/gym-proxy/sessions/move", AUTH, **body
        )
        assert (status, reply["moved"]) == (200, [session_id]), reply
    await attack(http, proxy.url, victim, session_id)


async def test_a_session_id_alone_does_not_open_a_restored_session(start_proxy, http, tmp_path):
    """Restored onto another worker count, the victim's session is placed by its alias:
    the forgeries still reach nothing of it."""
    proxy = start_proxy(workers=2, control_token=CONTROL)
    victim, session_id = await seed_victim(http, proxy.url)
    control = Control(http, proxy.url)
    await control.checkpoint("c1", str(tmp_path))
    proxy.kill_all()
    fresh = start_proxy(workers=3, control_token=CONTROL)
    control = Control(http, fresh.url)
    await control.ok("restore", checkpoint_id="r1", checkpoint_dir=str(tmp_path), episode_ids=[])
    await control.ok("resume", checkpoint_id="r1")
    await attack(http, fresh.url, victim, session_id)


async def test_a_session_id_alone_does_not_open_an_ownerless_restored_session(
    in_process, http, tmp_path, test_app
):
    """A single-process server's record names no owner: the restore places it in the
    session table, which only this instance's own token reaches."""
    base = tmp_path / "gym" / "resources" / "apps"
    record = {"episode_id": None, "session_id": "victim-1", "state": 500, "owner": None}
    write_checkpoint(
        base,
        [orjson.dumps(record)],
        kind="resources",
        instance="apps",
        checkpoint_id="c0",
        session_owners=[],
    )
    proxy = await in_process(workers=2, control_token=CONTROL, app=test_app)
    control = Control(http, proxy.url)
    await control.ok("restore", checkpoint_id="r1", checkpoint_dir=str(tmp_path), episode_ids=[])
    await control.ok("resume", checkpoint_id="r1")
    victim = TokenCodec(TEST_SECRET.encode(), "apps").sign("victim-1", None)
    await attack(http, proxy.url, victim, "victim-1")
