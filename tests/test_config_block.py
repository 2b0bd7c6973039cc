"""A NeMo Gym server block's `gym_proxy:` settings (proxy/config_block.py): what they
set, what a flag or the environment does beside them, and the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_proxy.proxy.config import ConfigError, config_from_args
from gym_proxy.proxy.config_block import apply_block

pytestmark = pytest.mark.fast

WHERE = "counter.resources_servers.example_session_state_mgmt.gym_proxy"


def test_the_block_sets_options_named_as_their_flags():
    config = apply_block(
        config_from_args([]),
        {"session_state": "session_id_to_counter", "max-connections": 64,
         "access_log": True, "graceful_timeout": 5, "kind": "agent"},
        WHERE,
    )  # fmt: skip
    assert config.session_state == "session_id_to_counter"
    assert (config.max_connections, config.access_log, config.kind) == (64, True, "agent")
    assert config.graceful_timeout == 5.0 and isinstance(config.graceful_timeout, float)
    assert {"session_state", "max_connections"} <= config.given


def test_a_flag_wins_over_the_block_and_the_block_over_the_environment(monkeypatch):
    monkeypatch.setenv("GYM_PROXY_SESSION_STATE", "from_env")
    monkeypatch.setenv("GYM_PROXY_RUNTIME_DIR", "/tmp/from-env")
    block = {"session_state": "from_block", "runtime_dir": "/tmp/from-block"}
    config = apply_block(config_from_args(["--runtime-dir", "/tmp/from-flag"]), block, WHERE)
    assert (config.session_state, config.runtime_dir) == ("from_block", "/tmp/from-flag")
    monkeypatch.delenv("GYM_PROXY_SESSION_STATE")
    assert config_from_args([]).session_state is None  # nothing set: the default


def test_secret_files_in_the_block_are_read_and_beat_the_environment(tmp_path: Path, monkeypatch):
    (tmp_path / "secret").write_text("from-the-file\n")
    monkeypatch.setenv("GYM_PROXY_SECRET", "from-the-environment")
    config = apply_block(config_from_args([]), {"secret_file": str(tmp_path / "secret")}, WHERE)
    assert config.secret == "from-the-file"
    flagged = apply_block(
        config_from_args(["--secret", "from-the-flag"]),
        {"secret_file": str(tmp_path / "secret")}, WHERE,
    )  # fmt: skip
    assert flagged.secret == "from-the-flag"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"workers": 4}, f"{WHERE}.workers cannot be set here: set the server's own `num_workers`"),
        ({"secret": "s"}, f"{WHERE}.secret cannot be set here: the config reaches every server"),
        ({"port": 1}, f"{WHERE}.port cannot be set here: set the server's own `port`"),
        ({"sesion_state": "x"}, f"{WHERE}.sesion_state is not a gym-proxy option"),
        ({"max_connections": "64"}, f"{WHERE}.max_connections must be a number, got '64'"),
        ({"max_connections": 6.5}, f"{WHERE}.max_connections must be a whole number"),
        ({"max_connections": float("inf")}, f"{WHERE}.max_connections must be a whole number"),
        ({"max_requests": float("nan")}, f"{WHERE}.max_requests must be a whole number"),
        ({"backlog": float("-inf")}, f"{WHERE}.backlog must be a whole number"),
        ({"access_log": "yes"}, f"{WHERE}.access_log must be true or false, got 'yes'"),
        ({"session_state": ["a"]}, f"{WHERE}.session_state must be text, got ['a']"),
        ({"kind": "robot"}, f"{WHERE}.kind must be one of resources, agent, environment, model"),
        ({"secret_file": "/nonexistent/secret"}, f"{WHERE}.secret_file /nonexistent/secret:"),
        (["session_state"], f"{WHERE} must be a mapping of gym-proxy options"),
    ],
)
def test_a_setting_that_cannot_work_is_one_line(block, message: str):
    with pytest.raises(ConfigError) as raised:
        apply_block(config_from_args([]), block, WHERE)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"max_workers": 1e30}, "--max-workers must be 0-256, got 1000000000000000019884624838656"),
        ({"min_workers": 100000}, "--min-workers must be 1-256, got 100000"),
        ({"max_workers": 300}, "--max-workers must be 0-256, got 300"),
    ],
)
def test_a_count_has_the_bounds_of_its_flag(block, message: str):
    config = apply_block(config_from_args([]), block, WHERE)
    with pytest.raises(ConfigError, match=f"^{message}$"):
        config.validate()


def test_no_block_changes_nothing():
    config = config_from_args([])
    assert apply_block(config, None, WHERE) is config


def _every_option(tmp_path: Path, ray: bool) -> dict[str, object]:
    """A block that sets every option it may, each to a value that is not its default
    (with Ray placement, or with --preload: the two exclude each other)."""
    secret, control = tmp_path / "secret", tmp_path / "control"
    secret.write_text("s3cret")
    control.write_text("t0ken")
    block: dict[str, object] = {
        "runtime_dir": str(tmp_path), "secret_file": str(secret), "graceful_timeout": 7.5,
        "orphan_grace": 12.0, "take_over": True, "upstream_timeout": 99.0,
        "keepalive_timeout": 33.0, "header_timeout": 4.0, "tunnel_idle_timeout": 77.0,
        "limit_request_line": 4000, "limit_request_headers": 30000, "max_connections": 300,
        "worker_timeout": 11.0, "metrics": "127.0.0.1:9999", "trace_requests": True,
        "max_requests": 500, "max_requests_jitter": 50, "max_worker_memory": 2048.0,
        "rebalance": True, "rebalance_ratio": 3.0, "stall_threshold": 2.5,
        "rebalance_cooldown": 20.0, "rebalance_max_moves": 4.0, "min_workers": 2,
        "max_workers": 6, "scale_up_busy": 6.0, "scale_up_after": 15.0,
        "scale_down_busy": 0.25, "scale_down_after": 90.0, "session_idle_ttl": 300.0,
        "boot_timeout": 45.0, "backlog": 512, "control_token_file": str(control),
        "cookie_name": "my_cookie", "session_state": "sessions", "kind": "agent",
        "lease_grace": 120.0, "log_level": "warning", "access_log": True,
    }  # fmt: skip
    if ray:
        block.update(worker_placement="ray", worker_cpus=0.5,
                     worker_resources='{"sandbox": 1}', worker_strategy="default",
                     placement_wait=90.0, local_workers=1)  # fmt: skip
    else:
        block["preload"] = True
    return block


@pytest.mark.parametrize("ray", [True, False], ids=["placed", "preloaded"])
def test_every_option_the_block_sets_takes_effect(tmp_path: Path, ray: bool):
    """Issue 56: the block has its whole say. Every option the block may set, each set to
    something other than its default: the config holds each (the secrets read from
    their files), and the settled config is valid; an option added to Config without a
    line here fails (so a new one is tried too). The log level's effect on gym-proxy's
    own log: tests/test_nemo_gym_servers.py."""
    from dataclasses import fields

    from gym_proxy.proxy.config import Config
    from gym_proxy.proxy.config_block import _REFUSED

    block = _every_option(tmp_path, ray)
    settable = {f.name for f in fields(Config) if not f.metadata.get("internal")} - set(_REFUSED)
    assert settable == set(_every_option(tmp_path, True)) | set(_every_option(tmp_path, False))
    config = apply_block(config_from_args([]), block, WHERE)
    config.validate()
    defaults = Config()
    for name, value in block.items():
        assert getattr(config, name) == value, name
        assert getattr(defaults, name) != value, f"{name}: the default, not a change"
    assert (config.secret, config.control_token) == ("s3cret", "t0ken")
    assert config.workers == 2  # with --max-workers and no count: the minimum
