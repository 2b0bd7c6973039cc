"""Restored episodes awaiting their replacement across a proxy crash
(coordinator/claims_recovery.py): which are still unclaimed, and the note a restore leaves."""

from __future__ import annotations

import logging

import pytest

from gym_proxy.coordinator.claims_recovery import claims_from, recall, remember, still_expected
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.marks import RetireMarks

pytestmark = pytest.mark.fast


def record(rollout: str, attempt: int) -> dict:
    return {"episode_id": {"rollout_id": rollout, "attempt": attempt}, "boundary": {"n": 1}}


def test_an_episode_is_unclaimed_only_if_every_rejoining_worker_still_expects_it():
    """A claim drops the attempt on the worker that made it (r2 on the second), and a
    worker expecting another attempt (r3) does not agree either."""
    expected = [{"r1": 1, "r2": 1, "r3": 2}, {"r1": 1, "r3": 1}]
    assert still_expected(expected) == {"r1": 1}
    assert still_expected([]) == {}


def test_claims_hold_the_records_of_the_expected_attempts_not_retired():
    marks = RetireMarks({"r3": 1})
    episodes = [record("r1", 0), record("r2", 4), record("r3", 0)]
    claims = claims_from(episodes, {"r1": 1, "r2": 2, "r3": 1}, marks)
    assert claims.keys() == ["r1-a1"]  # r2 continues as attempt 5, r3's attempt 1 is retired
    assert claims.check(EpisodeId("r1", 1)) == record("r1", 0)


def test_a_restore_note_reads_back_and_a_damaged_one_is_said(tmp_path, caplog):
    path = str(tmp_path / "restored.json")
    assert recall(path) is None
    remember(path, "/ckpt", {"b-a0", "a-a0"})
    assert recall(path) == ("/ckpt", {"a-a0", "b-a0"})
    (tmp_path / "restored.json").write_text("[1]")
    with caplog.at_level(logging.WARNING):
        assert recall(path) is None
    assert "is not a restore's note" in caplog.text
