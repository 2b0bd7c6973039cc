"""The worker's command line: written by the supervisor and read by the worker from one
declaration (`worker.options.WorkerArgs`), every server option taken from gym-proxy's
Config."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from gym_proxy.proxy.config import Config
from gym_proxy.worker.options import (
    FROM_CONFIG,
    INCARNATION,
    WorkerArgs,
    parse_worker_args,
    worker_argv,
)

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


def test_the_options_and_the_typed_arguments_are_one_declaration():
    """Every field of WorkerArgs is an option, of its field's type, and nothing else is;
    a server option has the type of the Config field of its name."""
    hints = typing.get_type_hints(WorkerArgs)
    options = [*INCARNATION, *FROM_CONFIG]
    assert [o.name for o in options] == [f.name for f in dataclasses.fields(WorkerArgs)]
    for option in options:
        hint = hints[option.name]
        if option.flag:
            assert hint is bool, option.name
        elif option.optional:
            assert typing.get_args(hint) == (option.type, type(None)), option.name
        else:
            assert hint is option.type and option.type in (int, float, str), option.name
    config = typing.get_type_hints(Config)
    for option in FROM_CONFIG:
        assert hints[option.name] == config[option.name], option.name


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
        "workers": 7,  # the supervisor's count as the worker starts, not --workers
    }
    argv = worker_argv(config, **incarnation)
    assert all(arg.startswith("--") for arg in argv) and "--access-log" in argv
    args = parse_worker_args(argv)
    assert isinstance(args, WorkerArgs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.slot = 3  # type: ignore[misc]  # frozen: what the worker was started with
    for option in INCARNATION:
        assert getattr(args, option.name) == incarnation[option.name]
    for option in FROM_CONFIG:
        assert getattr(args, option.name) == getattr(config, option.name), option.name


def test_unset_options_are_left_out():
    argv = worker_argv(
        Config(), slot=0, owner="o", socket="s", coordinator="c", instance="i", workers=1
    )
    assert not any(a.startswith(("--kind", "--session-state", "--access-log")) for a in argv)
    args = parse_worker_args(argv)
    assert args.kind is None and args.session_state is None and args.access_log is False


def test_an_option_the_worker_needs_is_required():
    """A value the worker cannot go without (its type allows no None) must be given."""
    argv = worker_argv(
        Config(), slot=0, owner="o", socket="s", coordinator="c", instance="i", workers=1
    )
    parse_worker_args(argv)
    for left_out in ("--slot=", "--app-dir=", "--graceful-timeout="):
        with pytest.raises(SystemExit):
            parse_worker_args([a for a in argv if not a.startswith(left_out)])
