"""The command line of a worker process, declared once.

The supervisor writes it (`worker_argv`) and the worker reads it (`parse_worker_args`)
from the same declaration. Two groups: what one incarnation is (its slot, owner ID and
sockets, chosen by the supervisor), and the server's own options, which are the fields of
gym-proxy's `Config` with the same names: their defaults and help live there, and the
supervisor passes every one of them, so the worker declares no default of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerOption", "INCARNATION", "FROM_CONFIG", "worker_argv", "parse_worker_args"]


@dataclass(frozen=True)
class WorkerOption:
    name: str
    type: Callable[[str], Any] = str
    flag: bool = False  # a bare --name when true, absent when false


INCARNATION = (
    WorkerOption("slot", int),
    WorkerOption("owner"),
    WorkerOption("socket"),
    WorkerOption("coordinator"),
    WorkerOption("instance"),  # the server's instance name (telemetry names it)
)
FROM_CONFIG = (
    WorkerOption("app"),
    WorkerOption("app_dir"),
    WorkerOption("workers", int),  # how many this server has (a NeMo Gym class needs it)
    WorkerOption("session_state"),
    WorkerOption("kind"),
    WorkerOption("graceful_timeout", float),
    WorkerOption("orphan_grace", float),  # how long it waits to be adopted
    WorkerOption("limit_request_line", int),  # the worker parses what the proxy lets through
    WorkerOption("limit_request_headers", int),
    WorkerOption("session_idle_ttl", float),
    WorkerOption("log_level"),
    WorkerOption("access_log", flag=True),
)


def worker_argv(config: object, **incarnation: object) -> list[str]:
    """`python -m gym_proxy.worker` options: `incarnation`'s, then `config`'s, as `--name=value`,
    one argument each, so a value that starts with `-` (one random owner ID in 64 does)
    can never be read as a flag. A None value (an unset option) is left out."""
    values = {o.name: incarnation[o.name] for o in INCARNATION}
    values.update({o.name: getattr(config, o.name) for o in FROM_CONFIG})
    flags = {o.name for o in FROM_CONFIG if o.flag}
    argv = []
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if name in flags:
            if value:
                argv.append(option)
        elif value is not None:
            argv.append(f"{option}={value}")
    return argv


def parse_worker_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's options (every incarnation option and `app` required)."""
    parser = argparse.ArgumentParser(prog="python -m gym_proxy.worker")
    for option in INCARNATION:
        parser.add_argument("--" + option.name.replace("_", "-"), type=option.type, required=True)
    for option in FROM_CONFIG:
        name = "--" + option.name.replace("_", "-")
        if option.flag:
            parser.add_argument(name, action="store_true")
        else:
            parser.add_argument(name, type=option.type, required=option.name == "app")
    return parser.parse_args(argv)
