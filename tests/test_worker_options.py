"""The worker's command line: written by the supervisor and read by the worker from one
declaration (`worker.options`), every server option taken from gym-proxy's Config."""

from __future__ import annotations

import dataclasses

import pytest

from gym_proxy.proxy.config import Config
from gym_proxy.worker.options import FROM_CONFIG, INCARNATION, parse_worker_args, worker_argv

pytestmark = pytest.mark.fast


def test_every_server_option_is_a_config_field_of_the_same_type():
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for option in FROM_CONFIG:
        assert option.name in fields, option.name
        default = fields[option.name].default
        if option.flag:
            assert default is False
        elif default is not None:
            assert option.type(str(default)) == default


def test_argv_round_trip_with_values_that_look_like_flags():
    config = Config(
        app="pkg.mod:create_app",
        workers=3,
        app_dir="/srv/my app",
        session_state="session_id_to_counter",
        kind="agent",
        graceful_timeout=12.5,
        session_idle_ttl=60.0,
        log_level="debug",
        access_log=True,
    )
    incarnation = {
        "slot": 2,
        "owner": "-h",
        "socket": "/run/w2.sock",
        "coordinator": "/run/c",
        "instance": "--counter",
    }
    argv = worker_argv(config, **incarnation)
    assert all(arg.startswith("--") for arg in argv) and "--access-log" in argv
    args = parse_worker_args(argv)
    for option in INCARNATION:
        assert getattr(args, option.name) == incarnation[option.name]
    for option in FROM_CONFIG:
        assert getattr(args, option.name) == getattr(config, option.name), option.name


def test_unset_options_are_left_out():
    argv = worker_argv(Config(), slot=0, owner="o", socket="s", coordinator="c", instance="i")
    assert not any(a.startswith(("--kind", "--session-state", "--access-log")) for a in argv)
    args = parse_worker_args(argv)
    assert args.kind is None and args.session_state is None and args.access_log is False
