"""Traces with real processes: NeMo Gym's telemetry on (NEMO_GYM_OTEL_ENABLED), gym-proxy
and its workers export over OTLP to a receiver this test runs; one checkpoint is one
trace, under the controller's own span, with NeMo Gym's span names and attributes, a
child from every worker (each its own service.instance.id). Requests' `traceparent`
and `tracestate` reach the worker untouched."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.support import CONTROL_TOKEN, Control, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "resource": resource,
                            "error": span.status.code == 2,
                        }
                    )
        return web.Response(status=200, content_type="application/x-protobuf")

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    receiver = Receiver()
    await receiver.start()
    yield receiver
    await receiver.close()


def otel_env(receiver: Receiver) -> dict[str, str]:
    return {
        "NEMO_GYM_OTEL_ENABLED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "nemo-gym",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the test waits for the export
    }


def controller_span() -> tuple[Tracer, InMemorySpanExporter]:
    """The controller's own tracer, in this process, as NeMo-RL's controller would have."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("controller"), exporter


async def test_one_checkpoint_is_one_trace_across_the_proxy_and_every_worker(
    start_proxy, receiver, tmp_path
):
    proxy = start_proxy(workers=2, control_token=CONTROL_TOKEN, env=otel_env(receiver))
    tracer, exporter = controller_span()
    async with aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 1}) as r:
                assert r.status == 200
        control = Control(http, proxy.url)
        with tracer.start_as_current_span("controller.checkpoint") as root:
            headers: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(headers)
            auth = {"Authorization": f"Bearer {CONTROL_TOKEN}", **headers}
            for op, extra in (
                ("prepare", {}),
                ("commit", {"checkpoint_dir": str(tmp_path)}),
                ("resume", {}),
            ):
                body = {"checkpoint_id": "ck-trace", "deadline_ts": Control.deadline(), **extra}
                async with http.post(f"{control.base}/{op}", json=body, headers=auth) as r:
                    assert r.status == 200, await r.text()
        trace_id = format(root.get_span_context().trace_id, "032x")
        root_id = format(root.get_span_context().span_id, "016x")

        def exported() -> bool:
            names = [s["name"] for s in receiver.spans]
            return (
                names.count("gym.checkpoint.wait_ready") >= 2
                and names.count("gym.checkpoint.export") >= 2
                and names.count("gym.checkpoint.resume") >= 3
                and "gym.checkpoint.write" in names
            )

        await wait_until(exported, 20, "the spans of the proxy and both workers")
    spans = [s for s in receiver.spans if s["trace_id"] == trace_id]
    assert len(spans) == len(receiver.spans), "every span is in the controller's trace"
    by_id = {s["span_id"]: s for s in spans}
    ops = {s["name"]: s for s in spans if s["parent"] == root_id}
    assert set(ops) == {"gym.checkpoint.prepare", "gym.checkpoint.commit", "gym.checkpoint.resume"}
    for span in ops.values():
        attributes = span["attributes"]
        assert attributes["nemo.gym.checkpoint.id"] == "ck-trace"
        assert attributes["nemo.gym.checkpoint.participant_kind"] == "resources"
        assert attributes["nemo.gym.checkpoint.instance"] == "apps"
        assert span["resource"]["service.instance.id"] == "apps-proxy"
        assert span["resource"]["service.name"] == "nemo-gym/apps"
    assert ops["gym.checkpoint.prepare"]["attributes"]["nemo.gym.checkpoint.phase"] == "prepared"
    assert ops["gym.checkpoint.prepare"]["attributes"]["nemo.gym.checkpoint.blockers"] == 0
    assert ops["gym.checkpoint.commit"]["attributes"]["nemo.gym.checkpoint.records"] == 6
    (write,) = [s for s in spans if s["name"] == "gym.checkpoint.write"]
    assert by_id[write["parent"]]["name"] == "gym.checkpoint.commit"
    assert write["attributes"]["nemo.gym.checkpoint.records"] == 6
    assert write["attributes"]["nemo.gym.checkpoint.bytes"] > 0
    for step, op in (("wait_ready", "prepare"), ("export", "commit"), ("resume", "resume")):
        children = [
            s for s in spans if s["name"] == f"gym.checkpoint.{step}" and s["parent"] != root_id
        ]
        assert {by_id[s["parent"]]["name"] for s in children} == {f"gym.checkpoint.{op}"}
        instances = {s["resource"]["service.instance.id"] for s in children}
        assert len(instances) == 2 and all(i.startswith("apps-w") for i in instances), instances
    exports = [s for s in spans if s["name"] == "gym.checkpoint.export"]
    assert sum(s["attributes"]["nemo.gym.checkpoint.records"] for s in exports) == 6
    assert exporter.get_finished_spans()[0].name == "controller.checkpoint"
    proxy.signal(signal.SIGTERM)
    assert proxy.wait_exit(30) == 0


async def test_a_refused_call_is_an_error_span(start_proxy, receiver):
    proxy = start_proxy(workers=1, control_token=CONTROL_TOKEN, env=otel_env(receiver))
    async with aiohttp.ClientSession() as http:
        control = Control(http, proxy.url)
        status, reply = await control.call("commit", checkpoint_id="ck-x", checkpoint_dir="/tmp/x")
        assert status == 409, reply
        await wait_until(lambda: receiver.named("gym.checkpoint.commit"), 20, "the span")
    (span,) = receiver.named("gym.checkpoint.commit")
    assert span["error"] and span["parent"] == ""


async def test_traceparent_and_tracestate_reach_the_worker_untouched(start_proxy):
    """With telemetry on or off, the proxy neither drops nor rewrites a request's trace
    context: the app (NeMo Gym's FastAPI instrumentation, here the test app) sees the
    caller's own."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracestate = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    for env in ({}, {"NEMO_GYM_OTEL_ENABLED": "1", "OTEL_TRACES_EXPORTER": "console"}):
        proxy = start_proxy(workers=2, env=env)
        async with aiohttp.ClientSession() as http:
            headers = {"traceparent": traceparent, "tracestate": tracestate}
            for _ in range(4):  # new sessions and both workers
                async with http.get(f"{proxy.url}/whoami", headers=headers) as response:
                    seen = (await response.json())["headers"]
                assert seen["traceparent"] == traceparent
                assert seen["tracestate"] == tracestate
        proxy.close_process()


async def test_trace_requests_adds_a_proxy_span_per_request(start_proxy, receiver):
    """--trace-requests: each request is a SERVER span of the proxy under the caller's
    traceparent, with its status and slot; the worker still sees the caller's own."""
    proxy = start_proxy("--trace-requests", workers=2, env=otel_env(receiver))
    caller_span = "b7ad6b7169203331"
    traceparent = f"00-0af7651916cd43dd8448eb211c80319c-{caller_span}-01"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.url}/whoami", headers={"traceparent": traceparent}) as r:
            assert (await r.json())["headers"]["traceparent"] == traceparent
            slot = (await r.json())["slot"]
        await wait_until(lambda: receiver.named("HTTP GET"), 20, "the request's span")
    (span,) = receiver.named("HTTP GET")
    assert span["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert span["parent"] == caller_span
    assert span["attributes"]["http.response.status_code"] == 200
    assert span["attributes"]["url.path"] == "/whoami"
    assert span["attributes"]["gym_proxy.slot"] == slot
