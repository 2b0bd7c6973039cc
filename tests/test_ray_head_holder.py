"""Who holds the Ray cluster gym-proxy started (proxy/ray_cluster/head.py, `_Holder`): `stop` ends
it; a holder that leaves without it (a proxy that died, or handed its workers over) lets
the next one in; one that said `stopping` first (its stop had begun) ends it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gym_proxy.proxy.ray_cluster.head import _Holder

pytestmark = pytest.mark.fast


def lines(*said: bytes) -> Callable[[], bytes]:
    remaining = list(said)
    return lambda: remaining.pop(0) if remaining else b""


@pytest.mark.parametrize(
    ("said", "waits_for_the_next"),
    [
        ((b"stop\n",), False),
        ((), True),  # its end without a word: it died, or handed over
        ((b"stopping\n",), False),
        ((b"something\n",), True),
    ],
)
def test_what_the_holder_said_decides(said, waits_for_the_next):
    holder = _Holder()
    holder.follow(lines(*said))
    assert holder.wait() is waits_for_the_next


def test_the_next_holder_s_own_words_count():
    holder = _Holder()
    holder.follow(lines())
    assert holder.wait() is True  # the first left: the next connects
    holder.follow(lines(b"stop\n"))
    assert holder.wait() is False


def test_a_signal_s_stop_ends_the_wait():
    holder = _Holder()

    def stopped_then_ended() -> bytes:
        holder.stop()
        return b""

    holder.follow(stopped_then_ended)
    assert holder.wait() is False
