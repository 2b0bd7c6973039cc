"""NeMo Gym's servers (FastAPI apps) run under gym-proxy unmodified.

The server is `tests/nemo_style.py`, written the way NeMo Gym writes resources servers:
Starlette SessionMiddleware cookies, state in its own dict keyed by its session ID, MCP
tokens minted in /seed_session. The clients behave as NeMo Gym's do: its ServerClient
keeps no cookie jar and sends on the cookies of the last response it got; MCP calls go
through the official `mcp` SDK client with the token from /seed_session.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.support import CONTROL_TOKEN, Control, ProxyProcess, wait_until

NEMO_APP = "tests.nemo_style:create_app"
MCP_TOKEN = "X-NeMo-Gym-Session-Token"


class NemoClient:
    """One rollout's calls, NeMo Gym style: cookies passed by hand, the last response's."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.cookies: dict[str, str] = {}
        self.mcp_token: str | None = None

    async def post(self, path: str, body: dict) -> dict:
        async with self.http.post(
            f"{self.url}{path}", json=body, cookies=self.cookies or None
        ) as resp:
            assert resp.status == 200, (path, resp.status, await resp.text())
            self.cookies = {name: morsel.value for name, morsel in resp.cookies.items()}
            return await resp.json()

    async def seed(self, count: int) -> dict:
        reply = await self.post("/seed_session", {"initial_count": count})
        self.mcp_token = reply["mcp"]["headers"][MCP_TOKEN]
        return reply


def nemo_http(force_close: bool = False) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),  # as NeMo Gym's global client
        connector=aiohttp.TCPConnector(limit=64, force_close=force_close),
        timeout=aiohttp.ClientTimeout(total=60),
    )


@pytest.mark.parametrize("new_connection_per_request", [False, True], ids=["pooled", "fresh"])
async def test_nemo_sessions_exact_under_four_workers(start_proxy, new_connection_per_request):
    proxy = start_proxy(workers=4, app=NEMO_APP)
    async with nemo_http(force_close=new_connection_per_request) as http:
        clients = [NemoClient(http, proxy.url) for _ in range(200)]
        gate = asyncio.Semaphore(40)
        pids: set[int] = set()

        async def rollout(i: int, client: NemoClient) -> None:
            async with gate:
                await client.seed(i)
                for step in range(5):
                    reply = await client.post("/increment_counter", {"count": 1})
                    assert reply["count"] == i + step + 1, (i, step, reply)
                    pids.add(reply["pid"])
                reply = await client.post("/verify", {"expected_count": i + 5})
                assert reply["reward"] == 1.0

        await asyncio.gather(*(rollout(i, c) for i, c in enumerate(clients)))
    assert len(pids) == 4  # the sessions were spread over every worker


async def mcp_increment(url: str, token: str, count: int = 1) -> dict:
    """One tool call through the official SDK client (it keeps the cookies it is sent)."""
    async with (
        create_mcp_http_client(headers={MCP_TOKEN: token}) as client,
        streamable_http_client(f"{url}/mcp", http_client=client) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        result = await session.call_tool("increment_counter", {"count": count})
        assert not result.isError, result.content
        return orjson.loads(result.content[0].text)


async def test_mcp_calls_with_the_apps_token_land_on_its_worker(start_proxy):
    proxy = start_proxy(workers=4, app=NEMO_APP)
    async with nemo_http() as http:
        clients = [NemoClient(http, proxy.url) for _ in range(12)]
        for i, client in enumerate(clients):
            await client.seed(100 * i)
        for i, client in enumerate(clients):
            # the tool refuses a session its worker does not hold: a wrong worker fails
            first = await mcp_increment(proxy.url, client.mcp_token, 1)
            second = await mcp_increment(proxy.url, client.mcp_token, 2)
            assert (first["count"], second["count"]) == (100 * i + 1, 100 * i + 3)
            assert first["pid"] == second["pid"]
            reply = await client.post("/increment_counter", {"count": 0})
            assert reply == {"count": 100 * i + 3, "pid": first["pid"]}


async def test_app_token_passes_unchanged_and_mints_nothing(start_proxy):
    proxy = start_proxy(workers=2, app=NEMO_APP)
    async with nemo_http() as http:
        client = NemoClient(http, proxy.url)
        await client.seed(7)
        # an MCP-like call: the app's token, plus an unrelated session cookie of the proxy
        async with http.post(f"{proxy.url}/seed_session", json={}) as resp:
            unrelated = resp.cookies[proxy.cookie].value
        async with http.post(
            f"{proxy.url}/mcp/",
            headers={
                MCP_TOKEN: client.mcp_token,
                "Accept": "application/json, text/event-stream",
                "Content-Type": "application/json",
            },
            cookies={proxy.cookie: unrelated},
            data=orjson.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "tools/call",
                    "params": {"name": "increment_counter", "arguments": {"count": 1}},
                }
            ),
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert proxy.cookie not in resp.cookies  # the proxy minted no session
            reply = await resp.json()
        assert not reply["result"].get("isError"), reply
        assert orjson.loads(reply["result"]["content"][0]["text"])["count"] == 8


def test_lifespan_startup_failure_stops_the_server(tmp_path):
    proxy = ProxyProcess(workers=2, app="tests.asgi_apps:broken_lifespan")
    try:
        assert proxy.wait_exit(60) == 3
        log = proxy.log()
        assert "cannot connect to the database" in log
        assert "cannot build app tests.asgi_apps:broken_lifespan" in log
    finally:
        proxy.close()


async def test_bare_asgi_app_without_lifespan(start_proxy, http):
    proxy = start_proxy(workers=1, app="tests.asgi_apps:bare_asgi")
    async with http.get(f"{proxy.url}/ng-rollout/r1/any/path") as resp:
        assert (await resp.text()) == "/ng-rollout/r1/any/path"  # the prefix reaches ASGI apps


async def test_sigterm_runs_lifespan_shutdown_and_exits(start_proxy, http):
    proxy = start_proxy(workers=2, app=NEMO_APP)
    async with http.get(f"{proxy.url}/whoami") as resp:
        assert resp.status == 200
    proxy.signal(15)
    assert await asyncio.to_thread(proxy.wait_exit, 30) == 0


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1)])
async def test_checkpoint_with_hooks_restores_onto_another_worker_count(
    start_proxy, tmp_path, before, after
):
    first = start_proxy(workers=before, app=NEMO_APP, control_token=CONTROL_TOKEN)
    async with nemo_http() as http:
        control = Control(http, first.url)
        clients = [NemoClient(http, first.url) for _ in range(10)]
        for i, client in enumerate(clients):
            await client.seed(10 * i)
            for _ in range(i % 3):
                await client.post("/increment_counter", {"count": 1})
        reply = await control.checkpoint("hooks", str(tmp_path))
        assert reply["manifest"]["record_count"] == 10
        first.kill_all()

        second = start_proxy(workers=after, app=NEMO_APP, control_token=CONTROL_TOKEN)
        control = Control(http, second.url)
        await control.ok("restore", checkpoint_id="r", checkpoint_dir=str(tmp_path), episode_ids=[])
        await control.ok("resume", checkpoint_id="r")
        for i, client in enumerate(clients):
            client.url = second.url
            expected = 10 * i + i % 3
            reply = await client.post("/increment_counter", {"count": 1})  # the same cookies
            assert reply["count"] == expected + 1, (i, reply)
            tool = await mcp_increment(second.url, client.mcp_token, 1)  # the same MCP token
            assert tool["count"] == expected + 2, (i, tool)


async def test_restart_only_app_never_blocks_and_reports_restarts(start_proxy, tmp_path):
    """A restart-only resources server exports nothing and names its episodes as restarts;
    a live session bound to no episode is state nothing would save or restart, so it is a
    blocker until it ends, never silently dropped."""
    proxy = start_proxy(
        workers=2, app="tests.nemo_style:create_restart_only_app", control_token=CONTROL_TOKEN
    )
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        for key in ("r1", "r2-a1"):
            async with http.post(f"{proxy.url}/ng-rollout/{key}/seed_session", json={}) as resp:
                assert resp.status == 200
        unbound = NemoClient(http, proxy.url)
        await unbound.seed(5)  # no episode
        reply = await control.ok("prepare", checkpoint_id="ro", deadline_ts=time.time() + 1)
        assert reply["phase"] == "preparing"
        assert reply["report"]["blockers"] == ["resources-unbound-sessions:1"]
        assert reply["report"]["counts"]["unbound_sessions"] == 1
        assert sorted(reply["report"]["restarts"]) == ["r1", "r2-a1"]
        await control.ok("resume", checkpoint_id="ro")
        assert (await unbound.post("/verify", {"expected_count": 5}))["reward"] == 1.0
        reply = await control.ok("prepare", checkpoint_id="ro2", deadline_ts=time.time() + 10)
        assert reply["phase"] == "prepared"
        assert sorted(reply["report"]["restarts"]) == ["r1", "r2-a1"]
        committed = await control.ok("commit", checkpoint_id="ro2", checkpoint_dir=str(tmp_path))
        assert committed["manifest"]["record_count"] == 0  # restart-only exports nothing
        await control.ok("resume", checkpoint_id="ro2")


async def test_only_a_seed_starts_tracking_an_app_session(start_proxy):
    """Every request of a NeMo Gym app gets a fresh app session, health checks too; only a
    2xx seed is tracked (and announced to the proxy), so the store does not fill up."""
    proxy = start_proxy(workers=2, app=NEMO_APP, control_token=CONTROL_TOKEN)
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        for _ in range(5):
            async with http.get(f"{proxy.url}/whoami") as resp:
                assert resp.status == 200
        client = NemoClient(http, proxy.url)
        await client.seed(1)
        reply = await control.ok("prepare", checkpoint_id="p", deadline_ts=time.time() + 5)
        assert reply["phase"] == "prepared" and reply["report"]["counts"]["sessions"] == 1
        await control.ok("resume", checkpoint_id="p")


async def test_verify_ends_the_session_and_its_routing_entry(start_proxy):
    proxy = start_proxy(workers=2, app=NEMO_APP)
    async with nemo_http() as http:
        client = NemoClient(http, proxy.url)
        await client.seed(3)
        assert (await mcp_increment(proxy.url, client.mcp_token, 1))["count"] == 4
        reply = await client.post("/verify", {"expected_count": 4})
        assert reply["reward"] == 1.0
        # the session ended: its token names no known session any more, so the call is
        # placed like new work and may land on a worker that never held it
        holders = set()
        for _ in range(6):
            async with (
                create_mcp_http_client(headers={MCP_TOKEN: client.mcp_token}) as mcp_http,
                streamable_http_client(f"{proxy.url}/mcp", http_client=mcp_http) as (r, w, _),
                ClientSession(r, w) as session,
            ):
                await session.initialize()
                result = await session.call_tool("increment_counter", {"count": 1})
                holders.add(result.isError)
        assert True in holders  # some call reached a worker without the session


async def test_ended_app_sessions_leave_the_proxys_routing_table(start_proxy):
    """The proxy routes an app's tokens by a table of the sessions its workers announced;
    sessions a worker ends by itself (here the idle TTL) are dropped from it too."""
    proxy = start_proxy(
        "--session-idle-ttl", "1", workers=2, app=NEMO_APP, control_token=CONTROL_TOKEN
    )
    async with nemo_http() as http:
        control = Control(http, proxy.url)
        clients = [NemoClient(http, proxy.url) for _ in range(4)]
        for i, client in enumerate(clients):
            await client.seed(i)
        assert (await control.ok("status"))["routed_sessions"] == 4

        async def table_empty() -> bool:
            return (await control.ok("status"))["routed_sessions"] == 0

        await wait_until(table_empty, 15, "the expired sessions to leave the table")
        # a client coming back after its session ended starts a new one, routed again
        await clients[0].seed(5)
        assert (await control.ok("status"))["routed_sessions"] == 1
        assert (await clients[0].post("/increment_counter", {"count": 1}))["count"] == 6
