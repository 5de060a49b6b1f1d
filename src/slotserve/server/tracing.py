"""OpenTelemetry traces (``--otlp-traces-endpoint``, vLLM's flag): one span per engine request,
with its queue, prefill and decode times, token counts and prefix-cache hits, exported over
OTLP/HTTP in batches by the SDK's background thread (off the event loop; an exporter that
cannot reach its endpoint drops spans and never slows or fails a request).

The data flow: :class:`TracingMiddleware` reads the W3C ``traceparent`` / ``tracestate`` of
each HTTP request into a context variable; ``generation.submit_prompts`` tells the trace of
the request it runs in which engine requests it submitted (:func:`note_submitted`); the model
registry hands every step's outputs to :meth:`RequestTracer.observe`, which opens nothing
until a request finishes and then records its whole span at once, with the times the engine
measured. Attribute names follow vLLM's (``gen_ai.*``) where they mean the same.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slotserve.engine.outputs import RequestOutput
from slotserve.server.middleware import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

    from slotserve.server.metrics import ServerMetrics


@dataclass
class RequestTrace:
    """One HTTP request's trace parent and the tracer its engine requests report to."""

    tracer: RequestTracer
    parent: Context | None
    http_request_id: str
    engine_request_ids: list[str] = field(default_factory=list)  # what it submitted


_current_trace: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "slotserve_request_trace", default=None
)


def note_submitted(engine_request_id: str) -> None:
    """The current HTTP request (if traced) submitted ``engine_request_id``."""
    trace = _current_trace.get()
    if trace is not None:
        trace.tracer.expect(engine_request_id, trace)


@dataclass
class _Live:
    trace: RequestTrace
    first_token: float | None = None


@dataclass
class RequestTracer:
    """Turns finished engine requests into spans (event loop only)."""

    tracer: Tracer
    # time.monotonic() to the epoch, for the engine's times.
    epoch_offset: float = field(default_factory=lambda: time.time() - time.monotonic())
    _live: dict[str, _Live] = field(default_factory=dict)

    def begin(self, headers: Mapping[str, str], http_request_id: str) -> RequestTrace:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=dict(headers))
        return RequestTrace(self, parent, http_request_id)

    def expect(self, engine_request_id: str, trace: RequestTrace) -> None:
        self._live[engine_request_id] = _Live(trace)
        trace.engine_request_ids.append(engine_request_id)

    def end(self, trace: RequestTrace) -> None:
        """The HTTP request is over: an engine request of it that never finished (its engine
        died under it, a span would have no times to record) is forgotten, not kept for
        ever. The finished ones were recorded already: outputs reach :meth:`observe` before
        the request's own stream."""
        for engine_request_id in trace.engine_request_ids:
            self._live.pop(engine_request_id, None)

    @property
    def live(self) -> int:
        """Engine requests whose spans are still to be recorded."""
        return len(self._live)

    def observe(self, model: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if live.first_token is None and any(d.token_ids for d in out.deltas):
                live.first_token = out.time
            if out.finished:
                del self._live[out.request_id]
                self._record(model, out, live)

    def _ns(self, monotonic: float) -> int:
        return int((monotonic + self.epoch_offset) * 1e9)

    def _record(self, model: str, out: RequestOutput, live: _Live) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        attributes: dict[str, Any] = {
            "gen_ai.request.id": out.request_id,
            "gen_ai.response.model": model,
            "gen_ai.usage.prompt_tokens": out.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": out.num_output_tokens,
            "gen_ai.usage.cached_tokens": out.num_cached_tokens,
            "gen_ai.latency.e2e": out.time - out.arrival_time,
            "slotserve.http_request_id": live.trace.http_request_id,
        }
        started = out.arrival_time
        if out.queue_seconds is not None:
            attributes["gen_ai.latency.time_in_queue"] = out.queue_seconds
            started += out.queue_seconds
        if live.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = live.first_token - out.arrival_time
            attributes["gen_ai.latency.time_in_model_prefill"] = live.first_token - started
            attributes["gen_ai.latency.time_in_model_decode"] = out.time - live.first_token
        reasons = [d.finish_reason for d in out.deltas if d.finish_reason is not None]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
        span = self.tracer.start_span(
            "llm_request",
            context=live.trace.parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(out.arrival_time),
        )
        if out.error is not None:
            span.set_status(Status(StatusCode.ERROR, out.error))
        span.end(end_time=self._ns(out.time))


def request_tracer(endpoint: str) -> RequestTracer:
    """A tracer exporting to ``endpoint`` (OTLP over HTTP, e.g.
    ``http://collector:4318/v1/traces``) in batches from the SDK's own thread."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): "
            "pip install -e '.[tracing]'"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "slotserve"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return RequestTracer(provider.get_tracer("slotserve"))


def observe_both(
    metrics: ServerMetrics, tracer: RequestTracer
) -> Callable[[str, list[RequestOutput]], None]:
    """The registry's output hook when tracing: the metrics, then the spans."""

    def observe(model: str, outputs: list[RequestOutput]) -> None:
        metrics.observe(model, outputs)
        tracer.observe(model, outputs)

    return observe


class TracingMiddleware:
    """Reads each HTTP request's W3C trace context into the request's context variable."""

    def __init__(self, app: ASGIApp, tracer: RequestTracer) -> None:
        self.app = app
        self._tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"traceparent", b"tracestate")
        }
        request_id = scope.get("state", {}).get("request_id", "")
        trace = self._tracer.begin(headers, request_id)
        token = _current_trace.set(trace)
        try:
            await self.app(scope, receive, send)
        finally:
            _current_trace.reset(token)
            self._tracer.end(trace)
