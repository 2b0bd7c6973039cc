"""The data path's state machines are data (`proxy.state_tables`): each module's drawing
of its transitions is its table, and a transition the table does not allow raises under
the tests (GYM_PROXY_STRICT_STATES=1) and is counted and logged once in production. The
lists of states the docs give (the data path's, a worker's, an operation's steps) are the
code's."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import get_args

import pytest

from gym_proxy.proxy import state_tables
from gym_proxy.proxy.data_path import client_connection, exchange
from gym_proxy.proxy.data_path.exchange import DONE, HELD, QUEUED, RESPONDING, STATE_NAMES, Exchange
from gym_proxy.proxy.fleet.operations.decommission import Step
from gym_proxy.proxy.metrics.registry import STATES as WORKER_STATES
from tests.data_path_rig import Rig

pytestmark = pytest.mark.fast

ARROW = re.compile(r"\s*--[^>]*->\s*")


def docstring(module: ModuleType) -> str:
    """From the source: a module compiled by mypyc keeps no docstring."""
    source = Path(module.__name__.removeprefix("gym_proxy.").replace(".", "/") + ".py")
    source = Path(__file__).parents[1] / source
    return ast.get_docstring(ast.parse(source.read_text())) or ""


def drawn(module: ModuleType) -> set[tuple[str, str]]:
    """The (from, to) pairs the module docstring's "Transitions" drawing shows: each line
    is states, then `--event-->` and states, as often as it goes on; `A | B` is either,
    and words in parentheses are comments."""
    doc = docstring(module)
    block = doc[doc.index("Transitions") :].split("\n\n")[1]
    pairs: set[tuple[str, str]] = set()
    for line in block.splitlines():
        steps = [re.sub(r"\(.*?\)", "", part) for part in ARROW.split(line.strip())]
        named = [re.findall(r"\b[A-Z]{3,}\b", step) for step in steps]
        assert len(named) >= 2 and all(named), line
        for left, right in zip(named, named[1:], strict=False):
            pairs.update((a, b) for a in left for b in right)
    return pairs


def table(transitions: dict[int, tuple[int, ...]], names: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(names[a].upper(), names[b].upper()) for a, nexts in transitions.items() for b in nexts}


def test_the_exchange_drawing_is_its_table():
    assert drawn(exchange) == table(exchange.TRANSITIONS, STATE_NAMES)
    assert set(exchange.TRANSITIONS) == set(range(len(STATE_NAMES)))


def test_the_client_connection_drawing_is_its_table():
    names = client_connection.PHASE_NAMES
    assert drawn(client_connection) == table(client_connection.TRANSITIONS, names)
    assert set(client_connection.TRANSITIONS) == set(range(len(names)))


def test_every_state_is_described_in_its_docstring():
    for module, names in (
        (exchange, STATE_NAMES),
        (client_connection, client_connection.PHASE_NAMES),
    ):
        doc = docstring(module)
        for name in names:
            assert re.search(rf"^    {name.upper()}\s", doc, re.M), (module.__name__, name)


def _exchange() -> Exchange:
    rig = Rig(workers=1)
    return Exchange(rig.client().protocol)


def test_a_wrong_transition_raises_under_the_tests():
    ex = _exchange()
    wrong = "exchange: no transition from queued to responding"
    with pytest.raises(state_tables.WrongTransition, match=wrong):
        ex._to(RESPONDING)
    assert ex.state == QUEUED
    ex._to(HELD)
    ex._to(DONE)
    with pytest.raises(state_tables.WrongTransition, match="from done to held"):
        ex._to(HELD)


def test_a_wrong_transition_in_production_is_counted_and_logged_once(monkeypatch, caplog):
    monkeypatch.delenv(state_tables.STRICT_ENV)
    monkeypatch.setattr(state_tables, "WRONG", {})
    ex = _exchange()
    with caplog.at_level(logging.ERROR, "gym_proxy.proxy"):
        for _ in range(3):
            ex.state = DONE
            ex._to(HELD)
    assert ex.state == HELD  # it goes on as before the tables: the request is not lost
    assert state_tables.WRONG == {("exchange", "done", "held"): 3}
    [record] = caplog.records
    assert record.getMessage().startswith("exchange: no transition from done to held (a gym")


# --- the docs' lists of states ----------------------------------------------------------

DOCS = Path(__file__).parents[1] / "docs"


def listed(page: str, pattern: str) -> list[str]:
    """The backticked names in the part of `page` that `pattern`'s group matches (the page
    with its line breaks folded: a list may wrap)."""
    text = " ".join((DOCS / page).read_text(encoding="utf-8").split())
    found = re.search(pattern, text)
    assert found, f"docs/{page} no longer has {pattern!r}: move this check with the list"
    return re.findall(r"`(\w+)`", found.group(1))


def test_the_design_page_lists_the_data_paths_states():
    phases = [n.upper() for n in client_connection.PHASE_NAMES]
    assert listed("design.md", r"phases of a client connection \(([^)]*)\)") == phases
    states = listed("design.md", r"`Exchange` \(`[^`]*`\) whose states \(([^)]*)\)")
    assert sorted(states) == sorted(n.upper() for n in STATE_NAMES)


def test_the_metrics_page_lists_the_worker_states():
    row = listed("metrics.md", r"`gym_proxy_workers` \|[^|]*\|[^|]*\|([^|]*)\|")
    assert row == list(WORKER_STATES)


def test_the_live_operations_page_lists_the_steps():
    steps = listed("live_operations.md", r"The `step` is one of (.*?) \(`proxy\.fleet")
    assert steps == list(get_args(Step))
