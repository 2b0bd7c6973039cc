"""What only the proxy knows, kept for a successor (proxy/fleet/supervision/intent.py), and the
orphan grace's default, settled where the config is built (`Config.settle_orphan_grace`):
a secret from any source gives 30 s, none gives 0, and NeMo Gym's launcher 0."""

from __future__ import annotations

import logging

import pytest

from gym_proxy.coordinator.contract.nemo_gym_env import CONFIG_PATH_ENV
from gym_proxy.proxy.config import DEFAULT_ORPHAN_GRACE, ConfigError, config_from_args
from gym_proxy.proxy.config_block import apply_block
from gym_proxy.proxy.fleet.supervision.intent import (
    INTENT_NAME,
    FleetIntent,
    load_intent,
    save_intent,
)

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


WHERE = "x.gym_proxy"


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_text("s\n")
    return str(path)


def test_the_grace_is_the_default_with_a_secret_from_any_source_and_0_without(
    secret_file, monkeypatch
):
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    assert config_from_args([]).orphan_grace == 0  # no successor could verify the tokens
    flag = config_from_args(["--secret", "s"])
    assert flag.orphan_grace == DEFAULT_ORPHAN_GRACE >= 30  # a supervisor restarts in time
    block = apply_block(config_from_args([]), {"secret_file": secret_file}, WHERE)
    assert block.orphan_grace == DEFAULT_ORPHAN_GRACE  # settled again with the block's secret
    given = config_from_args(["--secret", "s", "--orphan-grace", "7"])
    assert given.orphan_grace == 7
    in_block = apply_block(config_from_args([]), {"orphan_grace": 5.0}, WHERE)
    assert in_block.orphan_grace == 5


def test_under_nemo_gyms_launcher_the_grace_is_0_unless_given(secret_file, monkeypatch):
    """The launcher restarts no server that dies: nothing would adopt the workers."""
    monkeypatch.setenv(CONFIG_PATH_ENV, "counter")
    assert config_from_args(["--secret", "s"]).orphan_grace == 0
    block = apply_block(config_from_args([]), {"secret_file": secret_file}, WHERE)
    assert block.orphan_grace == 0
    both = {"secret_file": secret_file, "orphan_grace": 60}
    assert apply_block(config_from_args([]), both, WHERE).orphan_grace == 60
    assert config_from_args(["--secret", "s", "--orphan-grace", "7"]).orphan_grace == 7


def test_the_launcher_is_the_environment_gym_proxy_was_started_in(secret_file, monkeypatch):
    """gym-proxy sets the launcher's variable itself, for its workers, after the config is
    built (a NeMo Gym class given `--nemo-gym-config`): that does not make it launched."""
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    config = config_from_args([])
    monkeypatch.setenv(CONFIG_PATH_ENV, "counter")
    block = apply_block(config, {"secret_file": secret_file}, WHERE)
    assert block.orphan_grace == DEFAULT_ORPHAN_GRACE


def test_a_take_over_with_no_grace_is_refused(monkeypatch):
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    with pytest.raises(ConfigError, match="--take-over needs --orphan-grace above 0"):
        config_from_args(["--secret", "s", "--take-over", "--orphan-grace", "0"])
    # A grace that is 0 by default is start-up's to refuse, once the NeMo Gym config's
    # block has had its say: it may bring the secret (proxy/startup.py).
    assert config_from_args(["--take-over"]).orphan_grace == 0
    assert config_from_args(["--secret", "s", "--take-over"]).orphan_grace == DEFAULT_ORPHAN_GRACE
