"""Who holds the Ray cluster gym-proxy started (proxy/ray_cluster/head.py, `_Holder`): `stop` ends
it; a holder that leaves without it (a proxy that died, or handed its workers over) lets
the next one in; one that said `stopping` first (its stop had begun) ends it. A line the
holder sends that is not a message of its protocol (`proxy.ray_cluster.lines.RAY_HEAD`)
is refused on stderr, naming the holder, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gym_proxy.coordinator.contract.lines import encode_line
from gym_proxy.proxy.ray_cluster.head import _Holder
from gym_proxy.proxy.ray_cluster.lines import HOLDER, StopCluster, Stopping

pytestmark = pytest.mark.fast

STOP = encode_line(StopCluster())
STOPPING = encode_line(Stopping())


def lines(*said: bytes) -> Callable[[], bytes]:
    remaining = list(said)
    return lambda: remaining.pop(0) if remaining else b""


@pytest.mark.parametrize(
    ("said", "waits_for_the_next"),
    [
        ((STOP,), False),
        ((), True),  # its end without a word: it died, or handed over
        ((STOPPING,), False),
        ((b'{"type": "cluster", "address": "x", "auth_mode": null}\n',), True),  # the head's
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
    holder.follow(lines(STOP))
    assert holder.wait() is False


def test_a_signal_s_stop_ends_the_wait():
    holder = _Holder()

    def stopped_then_ended() -> bytes:
        holder.stop()
        return b""

    holder.follow(stopped_then_ended)
    assert holder.wait() is False


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"stop\n", "sent a line that is not JSON: b'stop\\n'"),  # the bare word of before
        (b'{"type": "halt"}\n', "sent a 'halt' message, which this protocol does not have"),
        (b'{"type": "stop", "now": true}\n', "sent a malformed message: stop: unknown key(s) now"),
        (b'{"stop": true}\n', "sent a line with no message type"),
        (b'{"type": "cluster", "address": "x"}\n', "cluster: missing key(s) auth_mode"),
    ],
)
def test_a_line_the_head_cannot_read_is_refused_naming_the_holder(capsys, line, why):
    """Refused in one line on stderr (the proxy's log), and not taken for a stop: the
    holder that then leaves lets the next one in, as one that said nothing."""
    holder = _Holder()
    holder.follow(lines(line))
    assert holder.wait() is True
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1 and refusal.startswith(f"gym-proxy Ray process: {HOLDER} ")
    assert why in refusal and refusal.endswith("; ignored\n")


def test_a_refused_line_leaves_the_holder_s_later_stop_in_force(capsys):
    holder = _Holder()
    holder.follow(lines(b"garbage\n", STOP))
    assert holder.wait() is False
    assert "not JSON" in capsys.readouterr().err
