"""The NeMo Gym tier: the released nemo-gym 0.7.0 itself, its own servers unmodified, each
behind its own gym-proxy, wired by NeMo Gym's global config and driven by NeMo Gym's own
rollout collection (tests/nemo_gym_stack.py). It runs in the Python 3.13 virtualenv
`tests/nemo_gym/install.sh` makes (nemo-gym requires 3.13); elsewhere it is skipped."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from tests.nemo_gym_stack import NemoStack, counter_rows  # noqa: E402

ROLLOUTS = 200
CONCURRENCY = 32
WORKERS = {"env": 4, "agent": 4, "resources": 4, "model": 2}


async def every_rollout_right(stack: NemoStack, http) -> None:  # type: ignore[no-untyped-def]
    """Start the stack, run the rollouts: every one finishes with reward 1.0."""
    stack.start()
    await stack.wait_serving(http)
    run = stack.start_rollouts(counter_rows(ROLLOUTS), CONCURRENCY).result()
    assert run.failures == [], run.failures[:3]
    assert (run.finished, run.right) == (ROLLOUTS, ROLLOUTS), run.rewards


async def test_the_stack_under_gym_proxy_finishes_every_rollout_right(http, tmp_path):
    """200 rollouts at concurrency 32 through four gym-proxies (4, 4, 4, 2 workers): every
    one finishes with reward 1.0, and every counter session's calls reached one worker
    (the resources workers' own access log says which served what)."""
    stack = NemoStack(tmp_path / "stack", workers=WORKERS)
    try:
        await every_rollout_right(stack, http)
        sessions = stack.sessions_by_worker("resources")
        assert len(sessions) >= ROLLOUTS  # a session per rollout, seen by the workers
        split = {sid: slots for sid, slots in sessions.items() if len(slots) > 1}
        assert not split, f"sessions served by two workers: {list(split.items())[:5]}"
        assert len(set().union(*sessions.values())) == WORKERS["resources"]  # all took part
    finally:
        stack.stop()


async def test_the_reference_one_uvicorn_process_per_server(http, tmp_path):
    """The same stack as NeMo Gym runs it itself (`python app.py`, one uvicorn process per
    server): the reference result the gym-proxy stack must equal."""
    stack = NemoStack(tmp_path / "stack", workers=None)
    try:
        await every_rollout_right(stack, http)
    finally:
        stack.stop()
