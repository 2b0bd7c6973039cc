"""`worker.collector.collector_paused`: the cyclic collector is held off for a bulk phase
and comes back as it was (on, or off when the app had turned it off), across nesting and
errors."""

from __future__ import annotations

import gc

import pytest

from gym_proxy.coordinator.contract.collector import collector_paused

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def collector_as_found():
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_held_off_for_the_phase_and_back_after_nested_phases_and_an_error():
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer phase still runs
        raise RuntimeError("the phase failed")
    assert gc.isenabled()


def test_a_collector_the_app_turned_off_stays_off():
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
