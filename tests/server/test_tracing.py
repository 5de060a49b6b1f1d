"""OpenTelemetry traces against a real OTLP/HTTP receiver on loopback: a span per request with
the engine's times, token counts and cache hits, continuing the client's W3C traceparent; an
endpoint that is down never fails or slows a request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import ServerProcess, _free_port, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow  # spawned servers

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
# Spans leave in batches; a short delay keeps the test short.
BATCH_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


class Receiver:
    """An OTLP/HTTP trace receiver: it decodes every export it is sent."""

    def __init__(self) -> None:
        self.spans: list[object] = []
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        received.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("traced"),
        "--slots", "2", "--otlp-traces-endpoint", receiver.url,
        env=BATCH_ENV,
    )  # fmt: skip
    yield proc
    stop_server(proc)


def _attributes(span: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:  # type: ignore[attr-defined]
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = (
            list(v.string_value for v in value.array_value.values)
            if kind == "array_value"
            else getattr(value, kind)
        )
    return out


def test_a_request_becomes_a_span_in_the_callers_trace(
    traced: ServerProcess, receiver: Receiver
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 5,
    }
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01", "x-request-id": "traced-1"}
    reply = httpx.post(f"{traced.api_url}/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200
    usage = reply.json()["usage"]

    def ours() -> list[object]:
        return [s for s in receiver.spans if s.trace_id.hex() == TRACE_ID]  # type: ignore[attr-defined]

    assert wait_until(lambda: bool(ours()), timeout=20), "no span reached the receiver"
    (span,) = ours()
    assert span.parent_span_id.hex() == PARENT_SPAN  # type: ignore[attr-defined]
    assert span.kind == 2  # type: ignore[attr-defined]  # SPAN_KIND_SERVER
    attributes = _attributes(span)
    assert attributes["slotserve.http_request_id"] == "traced-1"
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert "gen_ai.usage.cached_tokens" in attributes
    e2e = float(attributes["gen_ai.latency.e2e"])  # type: ignore[arg-type]
    parts = [
        float(attributes[f"gen_ai.latency.{name}"])  # type: ignore[arg-type]
        for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode")
    ]
    assert all(p >= 0 for p in parts)
    assert abs(sum(parts) - e2e) < 1e-6
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9  # type: ignore[attr-defined]
    assert abs(duration - e2e) < 1e-3


def test_a_receiver_that_is_down_never_fails_a_request(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/v1/traces"
    proc = start_server(tmp_path, "--slots", "2", "--otlp-traces-endpoint", dead, env=BATCH_ENV)
    try:
        for i in range(3):
            reply = httpx.post(
                f"{proc.api_url}/completions",
                json={"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 4},
                timeout=30,
            )
            assert reply.status_code == 200
        assert httpx.get(f"{proc.base_url}/health", timeout=5).status_code == 200
    finally:
        stop_server(proc)


def test_an_engine_request_that_never_finishes_leaves_nothing_behind() -> None:
    """Its engine died under it (no final output ever comes): when the HTTP request is over
    the tracer forgets it, while a sibling that finished was recorded as a span."""
    import asyncio
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from slotserve.engine.outputs import RequestOutput
    from slotserve.server.tracing import RequestTracer, TracingMiddleware, note_submitted

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = RequestTracer(provider.get_tracer("test"))
    now = time.monotonic()

    async def app(scope: object, receive: object, send: object) -> None:
        note_submitted("dies-with-its-engine")
        note_submitted("finishes")
        tracer.observe("m", [RequestOutput("finishes", finished=True, arrival_time=now, time=now)])
        assert tracer.live == 1

    async def nothing() -> dict[str, object]:
        return {"type": "http.disconnect"}

    async def ignore(message: object) -> None:
        pass

    scope = {"type": "http", "method": "POST", "headers": [], "state": {"request_id": "r"}}
    asyncio.run(TracingMiddleware(app, tracer)(scope, nothing, ignore))
    assert tracer.live == 0
    assert [span.name for span in exported.get_finished_spans()] == ["llm_request"]
