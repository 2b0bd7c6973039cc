"""The histograms of what takes time: a checkpoint control call, a live operation, and a
request of a moving session held at the proxy.

They are made before the parts that time things, which are given their `observe` at
construction (the control app, the live operations, the move table), and registered in
the one registry the metrics render (`proxy.metrics.registry`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["Durations"]

_CONTROL_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)


class Durations:
    """The three histograms, in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.checkpoint_seconds = Histogram(
            "gym_proxy_checkpoint_operation_seconds",
            "Checkpoint control calls by operation and outcome (ok, or the error code)",
            ["operation", "outcome"],
            buckets=_CONTROL_BUCKETS,
            registry=registry,
        )
        self.operation_seconds = Histogram(
            "gym_proxy_live_operation_seconds",
            "Live operations (drain, restart, resize, ...) by outcome",
            ["operation", "outcome"],
            buckets=_CONTROL_BUCKETS,
            registry=registry,
        )
        self.move_wait_seconds = Histogram(
            "gym_proxy_move_wait_seconds",
            "How long a request of a moving session (or of a worker being decommissioned) waited "
            "at the proxy",
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )

    def checkpoint(self, operation: str, outcome: str, seconds: float) -> None:
        self.checkpoint_seconds.labels(operation, outcome).observe(seconds)

    def operation(self, operation: str, outcome: str, seconds: float) -> None:
        self.operation_seconds.labels(operation, outcome).observe(seconds)

    def held(self, waits: list[float]) -> None:
        for wait in waits:
            self.move_wait_seconds.observe(wait)
