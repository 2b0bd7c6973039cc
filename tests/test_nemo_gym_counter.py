"""NeMo Gym's own counter (`resources_servers/example_session_state_mgmt`, unmodified)
behind gym-proxy, driven the way NeMo Gym's agents call it: sessions, MCP tokens, the
session lifecycle, checkpoints written by NeMo Gym's single-process servers (the NeMo Gym
tier; see tests/test_nemo_gym_stack.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from itsdangerous import TimestampSigner, URLSafeSerializer  # noqa: E402
from nemo_gym.base_resources_server import _MCP_TOKEN_SALT  # noqa: E402

from gym_proxy.coordinator import checkpoint_files as records  # noqa: E402
from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.support import (  # noqa: E402
    CONTROL_TOKEN,
    Control,
    ProxyProcess,
    wait_until,
    write_checkpoint,
)
from tests.test_nemo_gym_checkpoint import mcp_call  # noqa: E402

COUNTER = "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer"
INSTANCE = "counter"
COOKIE = f"StatefulCounterResourcesServer___{INSTANCE}"  # NeMo Gym's own session cookie


def counter_env(mcp: bool = False) -> dict[str, str]:
    """The config NeMo Gym's launcher would pass the counter."""
    block = {"entrypoint": "app.py", "host": "127.0.0.1", "port": 1, "domain": "agent"}
    if mcp:
        block["expose_tools_over_mcp"] = True
    config = {
        "head_server": {"host": "127.0.0.1", "port": free_port()},
        "dry_run": False,
        INSTANCE: {"resources_servers": {"example_session_state_mgmt": block}},
    }
    return {"NEMO_GYM_CONFIG_DICT": json.dumps(config), "NEMO_GYM_CONFIG_PATH": INSTANCE}


def nemo_http(force_close: bool = False) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),  # as NeMo Gym's global client
        connector=aiohttp.TCPConnector(limit=64, force_close=force_close),
        timeout=aiohttp.ClientTimeout(total=60),
    )


def start_counter(
    start_proxy: Callable[..., ProxyProcess],
    *args: str,
    workers: int = 4,
    mcp: bool = False,
    preload: bool = True,
    **kwargs: Any,
) -> ProxyProcess:
    """The counter under gym-proxy, with `--preload` as docs/nemo_gym.md recommends (NeMo
    Gym's imports cost 3.5-5 s of CPU a worker); the four-worker test's pooled case runs
    without it, so the spawned path carries NeMo Gym's counter too."""
    # --boot-timeout: as the stacks' (tests/nemo_gym_stack.py), for a busy machine.
    return start_proxy(
        "--name", INSTANCE, "--boot-timeout", "180", *(["--preload"] if preload else []),
        *args, workers=workers, app=COUNTER, env=counter_env(mcp), **kwargs,
    )  # fmt: skip


def movable_counter(start_proxy: Callable[..., ProxyProcess]) -> ProxyProcess:
    """Two workers of the counter, its session dict declared, MCP on, a control token."""
    return start_counter(
        start_proxy,
        "--session-state",
        "session_id_to_counter",
        workers=2,
        mcp=True,
        control_token=CONTROL_TOKEN,
    )


@pytest.mark.parametrize(
    ("new_connection_per_request", "preload"),
    [(False, False), (True, True)],
    ids=["pooled-spawned", "fresh-preloaded"],
)
async def test_every_session_exact_under_four_workers(
    start_proxy, new_connection_per_request, preload
):
    proxy = start_counter(start_proxy, preload=preload)
    async with nemo_http(force_close=new_connection_per_request) as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(200)]
        gate = asyncio.Semaphore(40)

        async def rollout(i: int, client: CounterClient) -> None:
            async with gate:
                await client.seed(i)
                for step in range(5):
                    await client.post("/increment_counter", {"count": 1})
                    assert await client.count() == i + step + 1, (i, step)
                assert await client.verify(i + 5) == 1.0

        await asyncio.gather(*(rollout(i, c) for i, c in enumerate(clients)))


async def test_restart_only_names_its_rollouts_and_an_unbound_session_blocks(start_proxy):
    """Declaring nothing, the counter is restart-only: seeds under rollout identity (0.7.0's
    indices, or the /ng-rollout/ prefix) are named as restarts; a live session bound to no
    episode is state nothing would save or restart, so it blocks prepare until it ends."""
    proxy = start_counter(start_proxy, workers=2, control_token=CONTROL_TOKEN)
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        await CounterClient(http, proxy.url, 3).seed(1)  # rollout 3-0
        async with http.post(
            f"{proxy.url}/ng-rollout/r9-a1/seed_session", json={"initial_count": 2}
        ) as resp:
            assert resp.status == 200
        unbound = CounterClient(http, proxy.url, 0)
        await unbound.post("/seed_session", {"initial_count": 5})  # no rollout identity
        reply = await control.ok("prepare", checkpoint_id="ro", deadline_ts=time.time() + 1)
        assert reply["phase"] == "preparing"
        assert reply["report"]["blockers"] == ["resources-unbound-sessions:1"]
        assert sorted(reply["report"]["restarts"]) == ["3-0", "r9-a1"]
        await control.ok("resume", checkpoint_id="ro")
        assert await unbound.verify(5) == 1.0  # the session ends
        reply = await control.ok("prepare", checkpoint_id="ro2")
        assert reply["phase"] == "prepared"
        await control.ok("resume", checkpoint_id="ro2")


async def test_only_a_seed_starts_tracking_a_session(start_proxy):
    """NeMo Gym gives every request a fresh session, health checks too; only a 2xx seed is
    tracked (and announced to the proxy), so nothing fills up with them."""
    proxy = start_counter(start_proxy, workers=2, control_token=CONTROL_TOKEN)
    async with nemo_http() as http:
        for _ in range(5):
            async with http.get(f"{proxy.url}/health") as resp:
                assert resp.status == 200
        await CounterClient(http, proxy.url, 1).seed(1)
        control = Control(http, proxy.url)
        reply = await control.ok("prepare", checkpoint_id="p")
        assert reply["phase"] == "prepared" and reply["report"]["counts"]["sessions"] == 1
        await control.ok("resume", checkpoint_id="p")
        assert (await control.ok("status"))["routed_sessions"] == 1


async def test_ended_sessions_leave_the_routing_table(start_proxy):
    """The proxy routes MCP tokens by a table of the sessions its workers announced; a
    session that ends (the counter's /verify, or the idle TTL) leaves it, and its token is
    then routed like new work. With its dict declared, the counter's entry of an ended
    session is released too: the client that comes back starts afresh."""
    proxy = start_counter(
        start_proxy,
        "--session-idle-ttl",
        "1",
        "--session-state",
        "session_id_to_counter",
        workers=2,
        mcp=True,
        control_token=CONTROL_TOKEN,
    )
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        clients = [CounterClient(http, proxy.url, task) for task in range(4)]
        for i, client in enumerate(clients):
            await client.seed(i)
        assert (await control.ok("status"))["routed_sessions"] == 4
        await mcp_call(proxy.url, clients[0].mcp_token, "increment_counter", {"count": 1})
        assert await clients[0].verify(1) == 1.0

        async def table_empty() -> bool:
            return (await control.ok("status"))["routed_sessions"] == 0

        await wait_until(table_empty, 15, "the ended and expired sessions to leave the table")
        await clients[1].seed(5)  # a client coming back starts a new session, routed again
        assert (await control.ok("status"))["routed_sessions"] == 1
        await clients[1].post("/increment_counter", {"count": 1})
        assert await clients[1].count() == 6


async def test_commit_binds_seeds_to_episodes_and_takes_stop(start_proxy, tmp_path):
    proxy = start_counter(
        start_proxy,
        "--session-state",
        "session_id_to_counter",
        workers=2,
        control_token=CONTROL_TOKEN,
    )
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        async with http.post(
            f"{proxy.url}/ng-rollout/r1-a2/seed_session", json={"initial_count": 3}
        ) as resp:
            assert resp.status == 200
        await CounterClient(http, proxy.url, 8).seed(4)  # rollout 8-0
        assert (await control.ok("prepare", checkpoint_id="ck"))["phase"] == "prepared"
        scope = [{"rollout_id": "r1", "attempt": 2}, {"rollout_id": "8-0", "attempt": 0}]
        reply = await control.ok(
            "commit",
            checkpoint_id="ck",
            checkpoint_dir=str(tmp_path),
            episode_ids=scope,
            stop=True,
        )
        assert sorted(reply["episode_ids"]) == ["8-0", "r1-a2"]  # capture keys
        assert reply["manifest"]["record_count"] == 2
        await control.ok("resume", checkpoint_id="ck")


def single_process_checkpoint(directory, sessions: dict[str, int]) -> None:
    """What NeMo Gym's one-process resources server writes (Gen-2's record shape): owner
    null, bound to episodes, a manifest without gym-proxy's extras."""
    lines = [
        orjson.dumps(
            {
                "episode_id": {"rollout_id": f"roll-{i}", "attempt": 0},
                "session_id": sid,
                "state": count,
                "owner": None,
            }
        )
        for i, (sid, count) in enumerate(sessions.items())
    ]
    write_checkpoint(
        records.checkpoint_path(str(directory), "resources", INSTANCE),
        lines,
        kind="resources",
        instance=INSTANCE,
        checkpoint_id="nemo-ck",
    )


async def test_restore_of_a_single_process_checkpoint_routes_nemo_gyms_own_clients(
    start_proxy, tmp_path
):
    """Its clients hold only NeMo Gym's own session cookie and MCP token (signed with the
    counter's own key); after the restore onto three workers they reach the worker that
    got their session, with its state."""
    sessions = {str(uuid.uuid4()): 10 * i for i in range(6)}
    single_process_checkpoint(tmp_path, sessions)
    proxy = start_counter(
        start_proxy,
        "--session-state",
        "session_id_to_counter",
        workers=3,
        mcp=True,
        control_token=CONTROL_TOKEN,
    )
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        scope = [{"rollout_id": f"roll-{i}", "attempt": 0} for i in range(len(sessions))]
        reply = await control.ok(
            "restore", checkpoint_id="r", checkpoint_dir=str(tmp_path), episode_ids=scope
        )
        assert reply["restored"] == sorted(f"roll-{i}-a1" for i in range(len(sessions)))
        await control.ok("resume", checkpoint_id="r")
        for sid, count in sessions.items():
            payload = base64.b64encode(orjson.dumps({"session_id": sid}))
            client = CounterClient(http, proxy.url, 0)
            client.cookies = {COOKIE: TimestampSigner(COOKIE).sign(payload).decode()}
            assert await client.count() == count, sid
            claims = {"sid": sid, "tools": None}
            token = URLSafeSerializer(COOKIE, salt=_MCP_TOKEN_SALT).dumps(claims)
            await mcp_call(proxy.url, token, "increment_counter", {"count": 2})
            assert await client.count() == count + 2, sid


async def test_nemo_gyms_counter_sessions_move_between_workers(start_proxy):
    """The real counter, its session dict declared: its sessions (NeMo Gym's own cookie
    and MCP tokens) move between live workers and keep their counts; a session no other
    worker holds is reported, not moved; moved twice, every one of them moves."""
    from gym_proxy.coordinator.contract.app_sessions import session_in_cookie_value

    proxy = movable_counter(start_proxy)
    move_path = f"{proxy.url}/ng-control/v1/gym-proxy/sessions/move"
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    async with nemo_http() as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(12)]
        for i, client in enumerate(clients):
            await client.seed(i)
        found = [session_in_cookie_value(c.cookies[COOKIE].encode()) for c in clients]
        ids = [session_id for session_id in found if session_id]
        assert len(ids) == len(found), found

        async def move(to_slot: int) -> dict:
            body = {"session_ids": ids, "to_slot": to_slot}
            async with http.post(move_path, json=body, headers=auth) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        first = await move(1)
        assert first["moved"] and first["failed"], first  # both workers held some
        assert sorted(first["moved"] + [f["session_id"] for f in first["failed"]]) == sorted(ids)
        for i, client in enumerate(clients):
            await mcp_call(proxy.url, client.mcp_token, "increment_counter", {"count": 1})
            await client.post("/increment_counter", {"count": 1})
            assert await client.count() == i + 2
        second = await move(0)  # all of them are on worker 1 now
        assert second["moved"] == sorted(ids) and second["failed"] == [], second
        for i, client in enumerate(clients):
            assert await client.count() == i + 2
            assert await mcp_call(proxy.url, client.mcp_token, "get_counter_value", {}) == {
                "count": i + 2
            }


async def test_nemo_gyms_counter_survives_a_rolling_restart_and_a_resize(start_proxy):
    """The real counter, its session dict declared: a rolling restart replaces both
    workers and a resize goes 2 -> 3 -> 1, and every session (NeMo Gym's own cookie and
    its MCP token) keeps its count and answers from a live worker."""
    proxy = movable_counter(start_proxy)
    workers = f"{proxy.url}/ng-control/v1/gym-proxy/workers"
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    before = set(proxy.worker_pids())
    async with nemo_http() as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(12)]
        for i, client in enumerate(clients):
            await client.seed(i)

        async def operate(name: str, body: dict) -> dict:
            async with http.post(f"{workers}/{name}", json=body, headers=auth) as response:
                reply = await response.json()
                assert response.status == 200 and reply["complete"], reply
                return reply

        restarted = await operate("restart", {})
        assert restarted["moved"] >= 12 and restarted["failed"] == [], restarted
        assert not set(proxy.worker_pids()) & before
        for i, client in enumerate(clients):
            await mcp_call(proxy.url, client.mcp_token, "increment_counter", {"count": 1})
            assert await client.count() == i + 1
        await operate("resize", {"workers": 3})
        await operate("resize", {"workers": 1})
        for i, client in enumerate(clients):
            await client.post("/increment_counter", {"count": 1})
            assert await client.count() == i + 2
            assert await mcp_call(proxy.url, client.mcp_token, "get_counter_value", {}) == {
                "count": i + 2
            }


async def test_a_restart_only_drain_waits_for_its_sessions_to_end(start_proxy):
    """Declaring nothing, the counter's sessions cannot move: a drain reports them at its
    timeout (they serve on where they are), and a drain with time enough ends once the
    sessions have (NeMo Gym's /verify ends one)."""
    proxy = start_counter(start_proxy, workers=2, control_token=CONTROL_TOKEN)
    drain_path = f"{proxy.url}/ng-control/v1/gym-proxy/workers/drain"
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    async with nemo_http() as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(8)]
        for i, client in enumerate(clients):
            await client.seed(i)

        async def drain(seconds: float) -> dict:
            body = {"slot": 0, "timeout_s": seconds}
            async with http.post(drain_path, json=body, headers=auth) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        reply = await drain(0.5)
        assert not reply["complete"] and reply["moved"] == 0, reply
        assert reply["slots"][0]["sessions_left"] >= 1, reply
        assert "restart-only" in reply["errors"][0], reply
        for i, client in enumerate(clients):
            assert await client.count() == i
        waiting = asyncio.ensure_future(drain(60))
        control = Control(http, proxy.url)

        async def draining() -> bool:
            return (await control.ok("status"))["operations"]["running"] is not None

        await wait_until(draining, 10, "the drain to run")
        for i, client in enumerate(clients):
            assert await client.verify(i) == 1.0  # the session ends
        reply = await asyncio.wait_for(waiting, 30)
        assert reply["complete"] and reply["slots"][0]["sessions_left"] == 0, reply
