"""What only the proxy knows, kept for a successor (proxy/fleet/intent.py), and the
orphan grace's default (a secret from any source gives 30 s, none gives 0)."""

from __future__ import annotations

import logging

import pytest

from gym_proxy.proxy.config import DEFAULT_ORPHAN_GRACE, ConfigError, config_from_args
from gym_proxy.proxy.config_block import apply_block
from gym_proxy.proxy.fleet.intent import INTENT_NAME, FleetIntent, load_intent, save_intent

pytestmark = pytest.mark.fast


def test_an_intent_reads_back_as_written(tmp_path):
    intent = FleetIntent(3, frozenset({"ownerA", "ownerB"}), {"old": "ownerA"})
    save_intent(str(tmp_path), intent)
    assert load_intent(str(tmp_path)) == intent
    assert [p.name for p in tmp_path.iterdir()] == [INTENT_NAME]  # no temporary left


@pytest.mark.parametrize(
    "damaged",
    [
        b"{not json",
        b"[]",
        b'{"workers": 0, "drained": []}',
        b'{"workers": 2}',
        b'{"workers": 2, "drained": [], "aliases": {"old": 3}}',
    ],
)
def test_a_damaged_intent_is_said_and_ignored(tmp_path, caplog, damaged):
    (tmp_path / INTENT_NAME).write_bytes(damaged)
    with caplog.at_level(logging.WARNING):
        assert load_intent(str(tmp_path)) is None
    assert "the command line's worker count, no drains" in caplog.text


def test_an_intent_from_before_aliases_were_kept_has_none(tmp_path):
    (tmp_path / INTENT_NAME).write_bytes(b'{"workers": 2, "drained": ["a"]}')
    assert load_intent(str(tmp_path)) == FleetIntent(2, frozenset({"a"}), {})


def test_no_intent_is_none(tmp_path):
    assert load_intent(str(tmp_path)) is None


def test_the_grace_is_the_default_with_a_secret_from_any_source_and_0_without(tmp_path):
    assert config_from_args([]).with_orphan_grace().orphan_grace == 0
    flag = config_from_args(["--secret", "s"]).with_orphan_grace()
    assert flag.orphan_grace == DEFAULT_ORPHAN_GRACE >= 30  # a supervisor restarts in time
    secret = tmp_path / "secret"
    secret.write_text("s\n")
    block = apply_block(config_from_args([]), {"secret_file": str(secret)}, "x.gym_proxy")
    assert block.with_orphan_grace().orphan_grace == DEFAULT_ORPHAN_GRACE
    given = config_from_args(["--secret", "s", "--orphan-grace", "7"]).with_orphan_grace()
    assert given.orphan_grace == 7


def test_a_take_over_with_no_grace_is_refused():
    with pytest.raises(ConfigError, match="--take-over needs --orphan-grace above 0"):
        config_from_args(["--secret", "s", "--take-over", "--orphan-grace", "0"])
