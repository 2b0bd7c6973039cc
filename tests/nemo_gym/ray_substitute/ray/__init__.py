"""gym-proxy's test substitute for Ray: what NeMo Gym 0.7.0's tested path calls, nothing
more (see ../README.md). A local cluster is never started."""

from __future__ import annotations

from typing import Any

__all__ = ["get_runtime_context", "init", "is_initialized", "shutdown"]

_state = {"initialized": False, "address": "127.0.0.1:6379"}


def is_initialized() -> bool:
    return bool(_state["initialized"])


def init(address: str | None = None, **_: Any) -> None:
    _state["initialized"] = True
    if address:
        _state["address"] = address


class _RuntimeContext:
    @property
    def gcs_address(self) -> str:
        return str(_state["address"])


def get_runtime_context() -> _RuntimeContext:
    return _RuntimeContext()


def shutdown() -> None:
    _state["initialized"] = False


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"ray.{name} is not available: this is gym-proxy's test substitute for Ray "
        "(tests/nemo_gym/ray_substitute), which provides only init, is_initialized, "
        "get_runtime_context and shutdown"
    )
