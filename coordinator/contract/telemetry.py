"""OpenTelemetry traces, in NeMo Gym's conventions, when NeMo Gym's telemetry is on.

On when `NEMO_GYM_OTEL_ENABLED` (else `NEMO_LENS_ENABLED`, as NeMo Gym reads them) is
1, true, yes or on, and the SDK is installed (`pip install 'gym-proxy[otel]'`); asked
for without the SDK, the log says so once. Then each process (the proxy and every
worker) has its own tracer provider: `service.name` is `OTEL_SERVICE_NAME` (default
`nemo-gym`) plus `/<instance>`, as NeMo Gym names its servers' services, and
`service.instance.id` tells the proxy from each worker incarnation. Spans go over OTLP
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and the SDK's other
variables; http/protobuf, or grpc when `OTEL_EXPORTER_OTLP_PROTOCOL` says so and its
exporter is installed) through a batch processor; `OTEL_TRACES_EXPORTER=console` prints
them instead, `none` turns traces off.

What is traced: each checkpoint control call is a span `gym.checkpoint.<op>` (prepare,
commit, restore, resume, retire, forget) parented under the `traceparent` the controller
sent, with NeMo Gym's `nemo.gym.checkpoint.*` attributes; its steps are children: in the
proxy `gym.checkpoint.write` and `gym.checkpoint.read`, and in every worker one span per
step (`wait_ready`, `export`, `install`, `resume`, `retire`, `forget`), reached over the
coordinator channel, which carries the `traceparent` (`TRACEPARENT`). Off, every
function here is a no-op and nothing is imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

__all__ = [
    "TRACEPARENT",
    "ATTRIBUTE",
    "wanted",
    "start",
    "shutdown",
    "span",
    "enabled",
    "provider",
]

log = logging.getLogger("gym_proxy.telemetry")

# The trace context a coordinator request carries to the worker (and the worker's handler
# runs under): a W3C traceparent, or None.
TRACEPARENT: ContextVar[str | None] = ContextVar("gym_proxy_traceparent", default=None)
ATTRIBUTE = "nemo.gym.checkpoint."  # NeMo Gym's attribute prefix
_TRUE = {"1", "true", "yes", "on"}
_tracer: Any = None
_provider: Any = None


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether NeMo Gym's telemetry is asked for (the first variable set decides)."""
    for name in ("NEMO_GYM_OTEL_ENABLED", "NEMO_LENS_ENABLED"):
        value = environ.get(name, "").strip()
        if value:
            return value.lower() in _TRUE
    return False


def enabled() -> bool:
    return _tracer is not None


def provider() -> Any:
    """This process's tracer provider (None when off)."""
    return _provider


def start(instance: str, instance_id: str, **resource: str) -> bool:
    """Set up this process's tracer when telemetry is wanted; True when it is on."""
    global _tracer, _provider
    if not wanted() or _tracer is not None:
        return _tracer is not None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "NEMO_GYM_OTEL_ENABLED is set but the OpenTelemetry SDK is not installed: "
            "no traces (pip install 'gym-proxy[otel]')"
        )
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or "nemo-gym"
    attributes = {
        "service.name": f"{name}/{instance}",
        "service.instance.id": instance_id,
        "nemo.gym.server.name": instance,
        **resource,
    }
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(BatchSpanProcessor(_exporter()))
    _tracer = _provider.get_tracer("gym_proxy")
    return True


def _exporter() -> Any:
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP over grpc asked for, but its exporter is not installed: http")
        else:
            return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown() -> None:
    """Flush and stop (at exit: the batch processor holds the last spans)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


@contextlib.contextmanager
def span(
    name: str, attributes: Mapping[str, Any] | None = None, parent: str | None = None
) -> Iterator[Any]:
    """A span `name` (INTERNAL) under `parent` (a traceparent; default: the current
    span, else TRACEPARENT's); inside, TRACEPARENT names it, so coordinator requests
    carry it. Yields the span (None when off). An exception marks it ERROR."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import context, trace
    from opentelemetry.trace import Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    carrier = parent or (None if trace.get_current_span().is_recording() else TRACEPARENT.get())
    ctx = propagator.extract({"traceparent": carrier}) if carrier else None
    with _tracer.start_as_current_span(
        name, context=ctx, attributes=dict(attributes or {}), record_exception=False,
        set_status_on_exception=False,
    ) as current:  # fmt: skip
        injected: dict[str, str] = {}
        propagator.inject(injected, context=context.get_current())
        token = TRACEPARENT.set(injected.get("traceparent"))
        try:
            yield current
        except Exception as exc:  # a cancellation is not an error (NeMo Gym's rule too)
            current.record_exception(exc)
            current.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            TRACEPARENT.reset(token)
