"""The data path's state machines as data: which transitions each allows, and what a wrong
one does.

`proxy.data_path.exchange` (an exchange's states) and `proxy.data_path.client_connection` (a
connection's phases) each declare their transitions as a table here, state -> the states it
may go to, and consult it (compiled into bit masks) on every change. A transition the table
does not allow is a bug in gym-proxy: it is counted (`gym_proxy_wrong_transitions_total`)
and logged once per pair; with `GYM_PROXY_STRICT_STATES=1` (the test suite sets it) it
raises `WrongTransition` instead, as h11 does, so a test that reaches one fails loudly. The
module docstrings draw the same tables; `tests/test_state_tables.py` checks each drawing
against its table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

__all__ = ["WrongTransition", "masks", "wrong_transition", "WRONG", "STRICT_ENV"]

log = logging.getLogger("gym_proxy.proxy")

STRICT_ENV = "GYM_PROXY_STRICT_STATES"  # "1": a wrong transition raises
# (machine, from, to) -> how many times; /metrics sums it by machine.
WRONG: dict[tuple[str, str, str], int] = {}


class WrongTransition(AssertionError):
    """A state machine was asked for a transition its table does not allow."""


def masks(table: Mapping[int, Sequence[int]], count: int) -> tuple[int, ...]:
    """`table` (state -> allowed next states) as one bit mask per state, indexed by state:
    bit `n` of `masks[s]` is set when `s` may go to `n`."""
    result = [0] * count
    for state, nexts in table.items():
        for following in nexts:
            result[state] |= 1 << following
    return tuple(result)


def wrong_transition(machine: str, names: Sequence[str], old: int, new: int) -> None:
    """Called instead of a transition its table refuses (module docstring)."""
    key = (machine, names[old], names[new])
    message = f"{machine}: no transition from {names[old]} to {names[new]}"
    if os.environ.get(STRICT_ENV) == "1":  # read here: only a wrong transition pays
        raise WrongTransition(message)
    first = key not in WRONG
    WRONG[key] = WRONG.get(key, 0) + 1
    if first:
        log.error("%s (a gym-proxy bug: please report it with this line)", message)
