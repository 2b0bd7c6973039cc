"""The command line of a worker process, declared once: the fields of `WorkerArgs`.

The supervisor writes it (`worker_argv`) and the worker reads it (`parse_worker_args`)
into a frozen `WorkerArgs`, both from the dataclass's fields, so an option cannot be
added to one and forgotten in the other. Two groups: what one incarnation is (its slot,
owner ID and sockets, and the server's worker count as it starts, chosen by the
supervisor), and the server's own options, which
are the fields of gym-proxy's `Config` with the same names and types: their defaults and
help live there, and the supervisor passes every one of them, so the worker declares no
default of its own. A field's type is its option's: an `int`, `float` or `str` value,
required; `X | None` may be left out (unset, None); a `bool` is a bare `--name`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "WorkerArgs",
    "WorkerOption",
    "INCARNATION",
    "FROM_CONFIG",
    "worker_argv",
    "parse_worker_args",
]


def _incarnation() -> Any:
    return dataclasses.field(metadata={"group": "incarnation"})


def _from_config() -> Any:
    return dataclasses.field(metadata={"group": "config"})


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker process is started with (`python -m gym_proxy.worker --name=value ...`)."""

    # What one incarnation is, chosen by the supervisor.
    slot: int = _incarnation()
    owner: str = _incarnation()
    socket: str = _incarnation()  # a Unix socket's path, or fd:N (worker.process.INHERITED)
    coordinator: str = _incarnation()  # its socket's path, or "accept" (worker.process.ACCEPT)
    instance: str = _incarnation()  # the server's instance name (telemetry names it)
    # How many workers the server has as this one starts (a NeMo Gym class needs it):
    # the supervisor's count, which a resize changes.
    workers: int = _incarnation()
    # The server's options: gym-proxy's Config fields of the same names and types.
    app: str = _from_config()
    app_dir: str = _from_config()
    session_state: str | None = _from_config()
    kind: str | None = _from_config()
    graceful_timeout: float = _from_config()
    orphan_grace: float | None = _from_config()  # how long it waits to be adopted
    limit_request_line: int = _from_config()  # the worker parses what the proxy lets through
    limit_request_headers: int = _from_config()
    session_idle_ttl: float = _from_config()
    log_level: str = _from_config()
    access_log: bool = _from_config()


@dataclass(frozen=True)
class WorkerOption:
    """One option of the command line, as `WorkerArgs` declares it."""

    name: str
    type: Callable[[str], Any] = str
    flag: bool = False  # a bare --name when true, absent when false
    optional: bool = False  # may be left out (None)


def _options(group: str) -> tuple[WorkerOption, ...]:
    hints = typing.get_type_hints(WorkerArgs)
    found = []
    for field in dataclasses.fields(WorkerArgs):
        if field.metadata["group"] != group:
            continue
        hint = hints[field.name]
        if hint is bool:
            found.append(WorkerOption(field.name, flag=True))
            continue
        kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
        found.append(WorkerOption(field.name, kinds[0], optional=kinds[0] is not hint))
    return tuple(found)


INCARNATION = _options("incarnation")
FROM_CONFIG = _options("config")


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


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerArgs:
    """The worker's options (each required unless its type allows None or it is a flag)."""
    parser = argparse.ArgumentParser(prog="python -m gym_proxy.worker")
    for option in (*INCARNATION, *FROM_CONFIG):
        name = "--" + option.name.replace("_", "-")
        if option.flag:
            parser.add_argument(name, action="store_true")
        else:
            parser.add_argument(name, type=option.type, required=not option.optional)
    return WorkerArgs(**vars(parser.parse_args(argv)))
