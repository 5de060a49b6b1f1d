"""The FastAPI application: thin routes over :mod:`slotserve.server.serving_*` and the model
host (SPEC S1-S7)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from slotserve.engine.prefix_cache import PrefixCacheStats
from slotserve.server.errors import error_response, install_error_handlers, request_id_of
from slotserve.server.metrics import EngineCollector, EngineSample, PrefixCacheCollector
from slotserve.server.middleware import ApiKeyMiddleware, RequestIdMiddleware
from slotserve.server.model_host import ModelState
from slotserve.server.protocol import ChatCompletionRequest, CompletionRequest
from slotserve.server.response_store import ResponseStore
from slotserve.server.responses_protocol import ResponsesRequest
from slotserve.server.serving import ServingContext
from slotserve.server.serving_chat import create_chat_completion
from slotserve.server.serving_completions import create_completion
from slotserve.server.serving_responses import create_response, get_response


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid parameters, or prompt + max_tokens over the context",
        401: "Missing or wrong API key (when the server has one)",
        404: "Unknown model",
        408: "The request did not finish within --request-timeout",
        429: "The waiting queue is full (see Retry-After)",
        500: "Internal error, naming the request id",
        503: "The model is loading, unhealthy or the server is shutting down",
    }.items()
}


def create_app(ctx: ServingContext) -> FastAPI:
    host = ctx.host
    ctx.metrics.register(EngineCollector(lambda: _engine_sample(ctx), ctx.model_name))
    ctx.metrics.register(PrefixCacheCollector(lambda: _prefix_stats(ctx), ctx.model_name))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Listen at once; readiness fails and generation gets a 503 until the model is in.
        loading = asyncio.ensure_future(host.load())
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await host.stop()

    app = FastAPI(title="slotserve", version="0.1.0", lifespan=lifespan)
    if ctx.api_key:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=ctx.api_key,
            on_refused=lambda: ctx.metrics.count_error(401, "invalid_request_error"),
        )
    app.add_middleware(RequestIdMiddleware)  # outermost: refusals carry the id too
    install_error_handlers(app, ctx.metrics.count_error)

    @app.post("/v1/chat/completions", responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw, request_id_of(raw))

    @app.post("/v1/completions", responses=_GENERATION_ERRORS)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw, request_id_of(raw))

    response_store = ResponseStore()

    @app.post("/v1/responses", responses=_GENERATION_ERRORS)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, body, raw, request_id_of(raw), response_store)

    @app.get("/v1/responses/{response_id}", responses={404: {"model": ErrorResponse}})
    async def stored_response(response_id: str) -> Response:
        return get_response(response_store, response_id, ctx.metrics.count_error)

    def model_card() -> dict[str, Any]:
        """The served model as vLLM describes it, with our state, runner and slots."""
        entry: dict[str, Any] = {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "slotserve",
            "root": ctx.model_name,
            "parent": None,
            "state": host.state.value,
        }
        if host.reason:
            entry["reason"] = host.reason
        model = host.model
        if model is not None:
            entry |= {
                "max_model_len": model.info.max_seq_len,
                "runner": model.info.runner,
                "slots": model.info.num_slots,
            }
        return entry

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    # ``:path``: model ids hold "/" (an HF repo id such as "org/name").
    @app.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorResponse}})
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the process serves or can recover by itself (loading,
        draining); 503 when the model is unhealthy or failed to load (a reload is needed)."""
        state = host.state
        status = "ok" if state is ModelState.READY else state.value
        body: dict[str, Any] = {"status": status}
        if host.reason:
            body["reason"] = host.reason
        broken = state in (ModelState.UNHEALTHY, ModelState.FAILED)
        return JSONResponse(body, 503 if broken else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 only when a generation request would be served now."""
        state = host.state
        if state is ModelState.READY:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": state.value, "reason": host.reason}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/reload", responses={409: {"model": ErrorResponse}})
    async def reload() -> JSONResponse:
        """Builds a new runner and engine (SPEC E11): recovers an unhealthy model. Requests
        still in the old engine end with an error first."""
        await host.load()
        if host.state is not ModelState.READY:
            ctx.metrics.count_error(500, "internal_server_error")  # counted like every error
            return error_response(
                500, f"Reloading the model failed: {host.load_error}.", "internal_server_error"
            )
        return JSONResponse({"status": "ready", "loads": host.loads})

    @app.get("/v1/slots")
    async def slots() -> dict[str, Any]:
        model = host.model
        if model is None:
            return {"state": host.state.value, "slots": []}
        stats = model.stats
        return {
            "state": host.state.value,
            "slots": [asdict(s) for s in stats.slots],
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
            "kv_used_tokens": stats.kv_used_tokens,
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "steps": stats.steps,
            "step_seconds": stats.step_seconds,
            "execute_seconds": stats.execute_seconds,
            "forward_seconds": model.engine.forward_seconds,
            "generated_tokens": stats.generated_tokens,
            "requests_submitted": stats.requests_submitted,
            "requests_finished": stats.requests_finished,
            "requests_aborted": stats.requests_aborted,
            "requests_failed": stats.requests_failed,
            "requests_timed_out": stats.requests_timed_out,
            "preemptions": stats.preemptions,
            "spec_decode": asdict(stats.spec_decode) if stats.spec_decode else None,
        }

    @app.get("/v1/prefix_cache_stats")
    async def prefix_cache_stats() -> dict[str, Any]:
        # Reads the snapshot the engine thread published after its last step: never blocks it.
        model = host.model
        stats = model.stats if model is not None else None
        return {
            **_prefix_stats(ctx).as_dict(),
            "integrity_checks": stats.integrity_checks if stats else 0,
            "integrity_failures": stats.integrity_failures if stats else 0,
            "last_integrity_error": stats.last_integrity_error if stats else None,
        }

    def openapi() -> dict[str, Any]:
        # Validation errors are answered with 400 in OpenAI's shape, not FastAPI's 422.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _engine_sample(ctx: ServingContext) -> EngineSample:
    host = ctx.host
    stats = host.model.stats if host.model is not None else None
    return EngineSample(host.state.value, host.loads, stats, host.totals())


def _prefix_stats(ctx: ServingContext) -> PrefixCacheStats:
    """The current engine's cache, its counters summed since the server started (a reload
    must not make a Prometheus counter go back)."""
    host = ctx.host
    current = (
        host.model.stats.prefix_cache
        if host.model is not None
        else PrefixCacheStats(False, "the model is not loaded")
    )
    return host.retired.with_prefix_counters(current)
