"""NeMo Gym's counter (`resources_servers/example_session_state_mgmt`, unmodified) behind
gym-proxy with no session state declared, so restart-only: the controller and
gym-proxy-ctl name the rollouts a checkpoint does not hold (the NeMo Gym tier; see
tests/test_nemo_gym_stack.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from gym_proxy.coordinator.clients.controller import Controller, Participant  # noqa: E402
from gym_proxy.coordinator.contract.episodes import EpisodeId  # noqa: E402
from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.support import CONTROL_TOKEN, REPO  # noqa: E402
from tests.test_nemo_gym_counter import nemo_http, start_counter  # noqa: E402

CTL_MAIN = "from gym_proxy.coordinator.clients.controller_cli import main; main()"


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-c",
        CTL_MAIN,
    ]
    return subprocess.run([*command, "--token", CONTROL_TOKEN, *args], cwd=REPO, text=True,
                          capture_output=True, timeout=60)  # fmt: skip


async def test_the_rollouts_a_restart_only_counter_cannot_save_are_named(start_proxy, tmp_path):
    """16 rollouts seeded as simple_agent seeds them (0.7.0's `_ng_task_index` and
    `_ng_rollout_index` in the body: each session is bound to rollout `<task>-0`); 4 of
    them end (`/verify`). A checkpoint saves nothing of the 12 still in flight: the
    controller's result names exactly those, by participant, and is not complete;
    gym-proxy-ctl prints them and exits 3. The rollouts carry on afterwards."""
    proxy = start_counter(start_proxy, workers=2, control_token=CONTROL_TOKEN)
    async with nemo_http() as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(16)]
        await asyncio.gather(*(client.seed(task) for task, client in enumerate(clients)))
        for task, client in enumerate(clients[:4]):
            assert await client.verify(task) == 1.0  # these rollouts end: their sessions too
        controller = Controller([Participant(proxy.url, CONTROL_TOKEN, http)], timeout=30)
        await controller.learn_kinds()
        outcome = await controller.checkpoint("ck3", str(tmp_path / "ck3"))
        in_flight = sorted(f"{task}-0" for task in range(4, 16))
        assert outcome.restarts == {proxy.url: tuple(EpisodeId(r, 0) for r in in_flight)}
        assert not outcome.complete and "partial: 12 rollout(s)" in outcome.summary()
        assert outcome.committed[proxy.url].manifest.record_count == 0

        result = await asyncio.to_thread(
            ctl, "--server", proxy.url, "checkpoint", "ck4", str(tmp_path / "ck4")
        )
        assert result.returncode == 3, (result.stdout, result.stderr)
        named = orjson.loads(result.stdout)["restarts"][proxy.url]
        assert named == [{"rollout_id": r, "attempt": 0} for r in in_flight]
        for task, client in enumerate(clients[4:], start=4):
            assert await client.verify(task) == 1.0  # resumed: the counters are all there
