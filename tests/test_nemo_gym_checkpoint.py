"""The NeMo Gym tier, across crashes: checkpoints of NeMo Gym's own stack, `kill -9` of
every server process, a restart on another worker count, restore, resume; the counter's
per-session dict declared as its state; NeMo Gym's MCP tool path with the real `mcp`
client (see tests/test_nemo_gym_stack.py for the tier)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared._httpx_utils import create_mcp_http_client  # noqa: E402
from mcp.types import TextContent  # noqa: E402

from gym_proxy.coordinator.clients.controller import Controller, Participant  # noqa: E402
from gym_proxy.coordinator.contract.episodes import parse_episode_key  # noqa: E402
from tests.nemo_gym_stack import SPECS, CounterClient, NemoStack, counter_rows  # noqa: E402
from tests.support import CONTROL_TOKEN, Control, wait_until  # noqa: E402

STATE = {"resources": ["--session-state", "session_id_to_counter"]}


def nemo_http() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),  # as NeMo Gym's global client
        timeout=aiohttp.ClientTimeout(total=60),
    )


def controller(stack: NemoStack, http: aiohttp.ClientSession) -> Controller:
    roles = [spec.role for spec in SPECS]
    return Controller([Participant(stack.url(r), CONTROL_TOKEN, http) for r in roles], 60)


async def crash_and_restore(
    stack: NemoStack,
    http: aiohttp.ClientSession,
    control: Control,
    workers: int,
    checkpoint_id: str,
    directory: Path,
    episodes: list[dict[str, Any]],
) -> None:
    """kill -9 the counter, start it on `workers` workers, restore `episodes`, resume."""
    stack.kill(("resources",))
    stack.start(workers={"resources": workers}, roles=("resources",))
    await stack.wait_serving(http)
    await control.ok(
        "restore", checkpoint_id=checkpoint_id, checkpoint_dir=str(directory),
        episode_ids=episodes,
    )  # fmt: skip
    await control.ok("resume", checkpoint_id=checkpoint_id)


async def held(http: aiohttp.ClientSession, stack: NemoStack) -> int:
    async with http.get(f"{stack.url('backend')}/control/held") as resp:
        return int((await resp.json())["held"])


async def test_rollouts_in_flight_across_a_crash_onto_other_worker_counts(http, tmp_path):
    """Rollouts held at their last model call (seeded and incremented at the counter) are
    in flight at a checkpoint: the restart-only environment and agent name them as
    restarts, so the commit continues none of them and says so. Every server is killed,
    restarted on other worker counts, restored and resumed; NeMo Gym's collection sends
    the rollouts it had in flight again, and every rollout finishes with reward 1.0."""
    stack = NemoStack(
        tmp_path / "stack", workers={"env": 2, "agent": 2, "resources": 4, "model": 2},
        gym_proxy_args=STATE,
    )  # fmt: skip
    rollouts = None
    try:
        stack.start()
        await stack.wait_serving(http)
        async with http.post(f"{stack.url('backend')}/control/hold") as resp:
            assert resp.status == 200
        rows = counter_rows(48)
        rollouts = stack.start_rollouts(rows, 16)

        async def sixteen_held() -> bool:
            return await held(http, stack) == 16

        await wait_until(sixteen_held, 120, "16 rollouts to wait at their last model call")
        ctl = controller(stack, http)
        await ctl.learn_kinds()
        prepared = await ctl.prepare("in-flight")
        assert prepared.prepared, prepared.blockers()
        restarts = prepared.restarts()
        assert len(restarts) == 16, restarts  # every rollout in flight, named
        by_role = {spec.role: prepared.replies[stack.url(spec.role)] for spec in SPECS}
        assert len(by_role["env"].report.restarts) == 16
        assert len(by_role["agent"].report.restarts) == 16
        resources = by_role["resources"].report
        assert resources.counts["sessions"] == 16 and resources.restarts == []
        scope = prepared.continued([parse_episode_key(key) for key in sorted(restarts)])
        assert scope == []  # nothing of them continues: the agent cannot capture its part
        committed = await ctl.commit("in-flight", str(tmp_path / "ck"), scope)
        assert all(reply.episode_ids == [] for reply in committed.values())

        stack.kill()  # every server process, gym-proxies and workers: kill -9
        async with http.post(f"{stack.url('backend')}/control/release") as resp:
            assert resp.status == 200
        stack.start(workers={"env": 1, "agent": 3, "resources": 2, "model": 1})
        await stack.wait_serving(http)
        ctl = controller(stack, http)
        await ctl.learn_kinds()
        await ctl.restore("in-flight", str(tmp_path / "ck"), scope)
        await ctl.resume("in-flight")
        run = rollouts.result()
        assert run.failures == [], run.failures[:3]
        assert (run.finished, run.right) == (48, 48), run.rewards
    finally:
        if rollouts is not None:
            rollouts.kill()
        stack.stop()


async def test_a_declared_session_dict_is_checkpointed_and_restored(tmp_path):
    """`--session-state session_id_to_counter`: the counter's own dict, keyed by NeMo
    Gym's session ID, is its state. Sessions seeded under 0.7.0's rollout indices are
    bound to their rollouts and exported; after a kill -9 they are restored onto another
    worker count and the same cookies carry on (the counter's own verify says 1.0)."""
    stack = NemoStack(tmp_path / "stack", workers={"resources": 4}, gym_proxy_args=STATE)
    try:
        async with nemo_http() as http:
            stack.start(roles=("resources",))
            await stack.wait_serving(http)
            clients = [CounterClient(http, stack.url("resources"), task) for task in range(24)]
            for i, client in enumerate(clients):
                await client.seed(10 * i)
                await client.post("/increment_counter", {"count": i})
            control = Control(http, stack.url("resources"))
            reply = await control.ok("prepare", checkpoint_id="state")
            assert reply["phase"] == "prepared" and reply["report"]["restarts"] == []
            episodes = [{"rollout_id": f"{i}-0", "attempt": 0} for i in range(24)]
            committed = await control.ok(
                "commit", checkpoint_id="state", checkpoint_dir=str(tmp_path / "ck"),
                episode_ids=episodes,
            )  # fmt: skip
            assert committed["manifest"]["record_count"] == 24
            assert sorted(committed["episode_ids"]) == sorted(f"{i}-0" for i in range(24))
            await crash_and_restore(stack, http, control, 3, "state", tmp_path / "ck", episodes)
            for i, client in enumerate(clients):
                assert await client.count() == 11 * i, i
                await client.post("/increment_counter", {"count": 1})
                assert await client.verify(11 * i + 1) == 1.0, i
            # verify ended the sessions: their dict entries were released with them
            reply = await control.ok("prepare", checkpoint_id="after")
            assert reply["report"]["counts"]["sessions"] == 0
            committed = await control.ok(
                "commit", checkpoint_id="after", checkpoint_dir=str(tmp_path / "ck2")
            )
            assert committed["manifest"]["record_count"] == 0
            await control.ok("resume", checkpoint_id="after")
    finally:
        stack.stop()


async def mcp_call(url: str, token: str, tool: str, arguments: dict) -> dict:
    """One tool call through the official `mcp` client, with the token the seed gave."""
    async with (
        create_mcp_http_client(headers={"X-NeMo-Gym-Session-Token": token}) as client,
        streamable_http_client(f"{url}/mcp", http_client=client) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        result = await session.call_tool(tool, arguments)
        assert not result.isError, result.content
        content = result.content[0]
        assert isinstance(content, TextContent), content
        return json.loads(content.text)


async def test_nemo_gyms_mcp_tools_reach_the_worker_that_holds_the_session(tmp_path):
    """`expose_tools_over_mcp`: NeMo Gym's MCP auto-exposure on the counter, behind four
    workers. Its token (itsdangerous, the app's own) routes every MCP call to the worker
    that holds the session, before and after a crash and a restore onto two workers."""
    stack = NemoStack(
        tmp_path / "stack", workers={"resources": 4}, gym_proxy_args=STATE, expose_mcp=True
    )
    try:
        async with nemo_http() as http:
            stack.start(roles=("resources",))
            await stack.wait_serving(http)
            url = stack.url("resources")
            clients = [CounterClient(http, url, task) for task in range(12)]
            for i, client in enumerate(clients):
                await client.seed(100 * i)
            results = await asyncio.gather(
                *(mcp_call(url, c.mcp_token, "increment_counter", {"count": 2}) for c in clients)
            )
            assert all(r == {"success": True} for r in results)
            for i, client in enumerate(clients):
                assert (await mcp_call(url, client.mcp_token, "get_counter_value", {})) == {
                    "count": 100 * i + 2
                }
            workers = stack.sessions_by_worker("resources")
            assert len(set().union(*workers.values())) > 1  # spread over the workers

            control = Control(http, url)
            episodes = [{"rollout_id": f"{i}-0", "attempt": 0} for i in range(12)]
            await control.checkpoint("mcp", str(tmp_path / "ck"), episode_ids=episodes)
            await crash_and_restore(stack, http, control, 2, "mcp", tmp_path / "ck", episodes)
            for i, client in enumerate(clients):
                await mcp_call(url, client.mcp_token, "increment_counter", {"count": 1})
                assert await client.verify(100 * i + 3) == 1.0, i
    finally:
        stack.stop()
