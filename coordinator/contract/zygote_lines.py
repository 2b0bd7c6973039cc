"""The lines between the supervisor and the zygote (`--preload`: `worker.zygote`, its
client `proxy.fleet.supervision.zygote_client`), over `coordinator.contract.lines`:

    supervisor -> zygote   fork     the worker's argv and environment (and, `fd`, one
                                    descriptor sent with the line, SCM_RIGHTS: `{fd}` in
                                    argv becomes its number; a Ray node's zygote gets
                                    each placed worker's bound socket so)
    zygote -> supervisor   forked   its pid        } one of them per fork, in the
                           refused  why not        } order the forks were asked
                           exited   a worker's pid and exit code (as asyncio's returncode:
                                    -signal when a signal ended it)
"""

from __future__ import annotations

from gym_proxy.coordinator.contract.messages import Message, message

__all__ = ["ZYGOTE", "Fork", "Forked", "ForkRefused", "ChildExited"]

ZYGOTE: dict[str, type[Message]] = {}  # its messages, by wire type


@message("fork", ZYGOTE)
class Fork(Message):
    argv: list[str]
    env: dict[str, str]
    fd: bool = False
    cwd: str = ""  # the worker's working directory, if this machine has it


@message("forked", ZYGOTE)
class Forked(Message):
    pid: int


@message("refused", ZYGOTE)
class ForkRefused(Message):
    error: str


@message("exited", ZYGOTE)
class ChildExited(Message):
    pid: int
    code: int
