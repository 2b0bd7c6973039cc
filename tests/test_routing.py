"""Unit tests of the routing decisions (pure logic, no sockets)."""

from __future__ import annotations

from collections import Counter

import pytest

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import SessionIdentity

pytestmark = pytest.mark.fast


def make_router(*owners: str) -> Router:
    router = Router()
    for slot, owner in enumerate(owners):
        router.add_worker(WorkerRoute(owner, slot, f"/tmp/{owner}.sock"))
    return router


def test_live_owner_routes_there_and_keeps_its_token():
    router = make_router("a", "b")
    route = router.route(SessionIdentity("s1", "b"), None)
    assert route.worker.owner == "b" and route.session_id == "s1" and not route.new


def test_alias_routes_to_new_holder_and_keeps_the_token():
    router = make_router("a", "b")
    router.set_tables({"old": "b"}, {})
    route = router.route(SessionIdentity("s1", "old"), None)
    assert route.worker.owner == "b" and not route.new


def test_unknown_owner_is_gone():
    router = make_router("a")
    with pytest.raises(GymError) as err:
        router.route(SessionIdentity("s1", "dead"), None)
    assert (err.value.status, err.value.code) == (410, "session_owner_gone")


def test_alias_to_dead_worker_is_gone():
    router = make_router("a")
    router.set_tables({"old": "b"}, {})
    with pytest.raises(GymError) as err:
        router.route(SessionIdentity("s1", "old"), None)
    assert err.value.status == 410


def test_ownerless_session_uses_table_then_places_and_remembers():
    router = make_router("a", "b")
    router.set_tables({}, {"known": "b"})
    assert router.route(SessionIdentity("known", None), None).worker.owner == "b"
    first = router.route(SessionIdentity("fresh", None), None)
    assert not first.new and first.session_id == "fresh"
    # the same ownerless session must keep landing on the same worker
    for _ in range(5):
        assert router.route(SessionIdentity("fresh", None), None).worker is first.worker


def test_owner_hint_lands_on_that_worker_as_new_session():
    router = make_router("a", "b", "c")
    for _ in range(5):
        route = router.route(None, "c")
        assert route.worker.owner == "c" and route.new
    router.set_tables({"old": "a"}, {})
    assert router.route(None, "old").worker.owner == "a"
    with pytest.raises(GymError):
        router.route(None, "nobody")


def test_token_beats_owner_hint():
    router = make_router("a", "b")
    assert router.route(SessionIdentity("s", "a"), "b").worker.owner == "a"


def test_new_sessions_round_robin_when_idle():
    router = make_router("a", "b", "c")
    owners = Counter(router.route(None, None).worker.owner for _ in range(300))
    assert owners == {"a": 100, "b": 100, "c": 100}


def test_new_session_goes_to_least_in_flight():
    router = make_router("a", "b", "c")
    router.workers["a"].in_flight = 5
    router.workers["b"].in_flight = 1
    router.workers["c"].in_flight = 3
    assert {router.route(None, None).worker.owner for _ in range(10)} == {"b"}


def test_no_live_worker_is_503():
    router = make_router("a")
    router.remove_worker("a")
    with pytest.raises(GymError) as err:
        router.route(None, None)
    assert (err.value.status, err.value.code) == (503, "worker_unavailable")
    with pytest.raises(GymError) as err:
        router.route(SessionIdentity("s", "a"), None)
    assert err.value.status == 410
