"""What a worker remembers of the sessions that moved away from it (worker/moved_away.py):
each until it comes back, bounded in count and, with an idle TTL, in age."""

from __future__ import annotations

import pytest

from gym_proxy.worker import moved_away
from gym_proxy.worker.moved_away import MovedAway

pytestmark = pytest.mark.fast


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_session_that_moved_away_is_remembered_until_it_comes_back():
    gone = MovedAway()
    gone.add(["a", "b"])
    assert "a" in gone and "b" in gone and "c" not in gone
    gone.discard(["a"])
    assert "a" not in gone and len(gone) == 1


def test_the_oldest_is_forgotten_past_the_bound(monkeypatch):
    monkeypatch.setattr(moved_away, "MAX_KEPT", 3)
    gone = MovedAway()
    gone.add(["a", "b", "c"])
    gone.add(["a"])  # moved away again: now the newest
    gone.add(["d"])
    assert "b" not in gone and {"c", "a", "d"} == {k for k in "abcd" if k in gone}


def test_with_an_idle_ttl_none_outlives_what_the_session_would_have():
    clock = Clock()
    gone = MovedAway(idle_ttl=60.0, clock=clock)
    gone.add(["a"])
    clock.now += 30
    gone.add(["b"])
    clock.now += 31  # a: 61 s, past the TTL; b: 31 s
    gone.add(["c"])
    assert "a" not in gone and "b" in gone and "c" in gone
