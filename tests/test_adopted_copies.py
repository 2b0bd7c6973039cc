"""A session two adopted workers hold (a move cut by a crash) stays with the later user."""

from __future__ import annotations

import pytest

from gym_proxy.proxy.fleet.supervision.adopted_copies import AdoptedCopies

pytestmark = pytest.mark.fast


def test_each_session_routes_to_the_worker_that_used_it_last():
    copies = AdoptedCopies()
    # The source rejoins first: its copy of s1 was last used at 10 (before the move).
    assert copies.take("source", {"s1": 10.0, "s2": 11.0}) == (["s1", "s2"], {})
    # The target installed s1 at 12 and served it at 15: the source drops its copy.
    assert copies.take("target", {"s1": 15.0, "s3": 1.0}) == (["s1", "s3"], {"source": ["s1"]})
    # A third worker with an older copy of s1 drops its own.
    assert copies.take("third", {"s1": 12.0}) == ([], {"third": ["s1"]})


def test_the_order_the_workers_rejoin_in_does_not_matter():
    first = AdoptedCopies()
    first.take("target", {"s1": 15.0})
    assert first.take("source", {"s1": 10.0}) == ([], {"source": ["s1"]})


def test_after_the_adoption_nothing_is_remembered():
    copies = AdoptedCopies()
    copies.take("a", {"s1": 5.0})
    copies.clear()
    assert copies.take("b", {"s1": 1.0}) == (["s1"], {})
