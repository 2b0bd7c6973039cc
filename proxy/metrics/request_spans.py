"""Per-request spans of the proxy (`--trace-requests`, with NeMo Gym's telemetry on).

Off by default: a span per request costs on the hot path what the rest of the proxy
does. On, each request is a SERVER span `HTTP <METHOD>` under the caller's
`traceparent`, ended when its answer is written, with the status, the worker slot that
served it and the path without its query. The request's own `traceparent` and
`tracestate` still reach the worker untouched: the worker's spans are the caller's
children, beside the proxy's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestSpans"]


class RequestSpans:
    """What the exchange calls at a request's start and end (`ProxyState.request_spans`,
    a `proxy.data_path.client_connection.RequestTracer`)."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = trace.get_tracer("gym_proxy.requests", tracer_provider=_provider())
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> Any:
        carrier = {}
        for name, value in headers:
            lowered = name.lower()
            if lowered in (b"traceparent", b"tracestate"):
                carrier[lowered.decode()] = value.decode("latin-1")
        verb = method.decode("latin-1")
        return self._tracer.start_span(
            f"HTTP {verb}",
            context=self._propagator.extract(carrier) if carrier else None,
            kind=self._kind,
            attributes={
                "http.request.method": verb,
                "url.path": url.partition(b"?")[0].decode("latin-1"),
            },
        )

    def end(self, span: Any, status: int, slot: int) -> None:
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("gym_proxy.slot", slot)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end()


def _provider() -> Any:
    from gym_proxy.coordinator.contract import telemetry

    return telemetry.provider()
