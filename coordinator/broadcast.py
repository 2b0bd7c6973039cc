"""One request to many workers at once: the fan-out the checkpointer, the live operations
and the metrics share.

Every worker is asked at the same moment with the same time limit, and every answer
comes back, in the workers' order, beside its worker: the reply, or the exception its
request ended with (ChannelClosed, ChannelTimeout, RemoteError, ...). What a failure
means is the caller's: a checkpoint refuses the whole call, a move names the worker that
did not answer, the metrics leave its figures out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from gym_proxy.coordinator.contract.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RemoteError,
)
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.messages import Message, Request

__all__ = ["HasChannel", "broadcast", "channel_of", "all_answer"]


class HasChannel(Protocol):
    @property
    def channel(self) -> Channel | None: ...


class InSlot(HasChannel, Protocol):
    @property
    def slot(self) -> int: ...


def channel_of(worker: HasChannel) -> Channel:
    """The channel of a live worker (it has one from its registration on)."""
    channel = worker.channel
    assert channel is not None, "a live worker has a channel"
    return channel


W = TypeVar("W", bound=HasChannel)
R = TypeVar("R", bound=Message)


async def broadcast(
    workers: Sequence[W],
    message: Request[R] | Callable[[W], Request[R]],
    within: float | None,
) -> list[tuple[W, R | BaseException]]:
    """Send `message` (or the one `message(worker)` makes for it) to every worker;
    `within` seconds for all (None: as long as each channel lives). Each worker with its
    reply or the exception its request raised."""
    requests: list[Awaitable[R]] = []
    for worker in workers:
        request = message(worker) if callable(message) else message
        requests.append(channel_of(worker).request(request, within))
    results = await asyncio.gather(*requests, return_exceptions=True)
    return list(zip(workers, results, strict=True))


S = TypeVar("S", bound=InSlot)


async def all_answer(
    workers: Sequence[S],
    message: Request[R] | Callable[[S], Request[R]],
    within: float,
) -> list[R]:
    """`broadcast`, where any failure refuses the whole call (a checkpoint's steps): the
    replies in the workers' order, or GymError naming the first worker that failed. A
    `message(worker)` is made once per worker (an Install carries megabytes)."""
    if not workers:
        return []
    if callable(message):
        made = {id(worker): message(worker) for worker in workers}
        what = made[id(workers[0])].TYPE
        message = lambda worker: made[id(worker)]  # noqa: E731
    else:
        what = message.TYPE
    replies = []
    for worker, result in await broadcast(workers, message, within):
        if isinstance(result, ChannelTimeout):
            raise GymError(
                "deadline_exceeded", f"worker {worker.slot} did not answer {what} by deadline_ts"
            )
        if isinstance(result, ChannelClosed):
            raise GymError("invalid_phase", f"worker {worker.slot} was lost during {what}")
        if isinstance(result, RemoteError):
            raise GymError(result.code, f"{what} on worker {worker.slot}: {result.detail}")
        if isinstance(result, BaseException):
            raise result
        replies.append(result)
    return replies
