"""What a worker's channel says reaches the part it is for (`proxy.assembly`): ended
sessions the router, reports and claims the checkpointer, and nothing else passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.messages import Claim, Reopen, SessionsEnded
from gym_proxy.proxy.assembly import Assembly
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.supervision.launchers import SubprocessLauncher
from gym_proxy.proxy.runtime_dir import RuntimeDir

pytestmark = pytest.mark.fast


@pytest.fixture
async def parts(tmp_path: Path) -> Assembly:
    runtime = RuntimeDir(str(tmp_path))
    return Assembly.build(Config(workers=2), runtime, b"secret", SubprocessLauncher())


async def test_ended_sessions_leave_the_router_tables_and_nothing_else(parts: Assembly):
    parts.router.sessions.update({"s1": "w0", "s2": "w1", "s3": "w0"})
    assert await parts.on_message("w0", SessionsEnded(["s1", "s2"])) is None
    # s2 is w1's: a worker ends only the sessions the table sends to it.
    assert parts.router.sessions == {"s2": "w1", "s3": "w0"}


async def test_a_claim_goes_to_the_checkpointer(parts: Assembly):
    with pytest.raises(GymError) as refused:
        await parts.on_message("w0", Claim("r1", 1, ""))
    assert refused.value.code == "stale_attempt"  # the checkpointer's word: nothing restored


async def test_a_message_for_no_part_is_refused(parts: Assembly):
    with pytest.raises(GymError) as refused:
        await parts.on_message("w0", Reopen())
    assert refused.value.code == "invalid_request"
