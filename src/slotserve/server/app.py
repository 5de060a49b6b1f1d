"""The FastAPI application: thin routes over the API modules (``openai/``, ``responses/``)
and the model host."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotserve.engine.prefix_cache.stats import PrefixCacheStats
from slotserve.hosting.served import ModelState
from slotserve.server.access_middleware import AccessMiddleware
from slotserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from slotserve.server.anthropic.serving import count_tokens, create_message
from slotserve.server.embeddings import EmbeddingRequest, create_embeddings
from slotserve.server.errors import (
    AnthropicErrorResponse,
    ErrorResponse,
    install_error_handlers,
    request_id_of,
)
from slotserve.server.lora_routes import lora_routes
from slotserve.server.middleware import BodyLimitMiddleware, RequestIdMiddleware
from slotserve.server.model_routes import model_routes, prefix_stats
from slotserve.server.openai.chat import create_chat_completion
from slotserve.server.openai.completions import create_completion
from slotserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from slotserve.server.openai.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from slotserve.server.openapi import build_openapi
from slotserve.server.responses.protocol import ResponsesRequest
from slotserve.server.responses.serving import create_response, get_response
from slotserve.server.responses.store import ResponseStore
from slotserve.server.scoring import RerankRequest, ScoreRequest, create_rerank, create_score
from slotserve.server.scrape_metrics import EngineCollector, EngineSample, PrefixCacheCollector
from slotserve.server.serving import ServingContext
from slotserve.server.tracing import TracingMiddleware
from slotserve.server.worker_routes import worker_routes

_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid parameters, or prompt + max_tokens over the context",
        413: "The request body is over --max-request-bytes",
        401: "Missing or wrong API key (when the server has one)",
        404: "Unknown or unloaded model (the message names the loaded ones)",
        408: "The request did not finish within --request-timeout",
        429: "The waiting queue is full (see Retry-After)",
        500: "Internal error, naming the request id",
        503: "The model is loading, unhealthy, unloading, or the server is shutting down",
    }.items()
}


# The same statuses on the Messages API, in Anthropic's error shape.
_MESSAGES_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {**answer, "model": AnthropicErrorResponse}
    for status, answer in _GENERATION_ERRORS.items()
}

_TOKENIZATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: _GENERATION_ERRORS[status] for status in (400, 401, 404, 503)
}


def create_app(ctx: ServingContext) -> FastAPI:
    models = ctx.models
    ctx.metrics.register(EngineCollector(lambda: _engine_samples(ctx)))
    ctx.metrics.register(PrefixCacheCollector(lambda: _prefix_samples(ctx)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Listen at once; readiness fails and generation gets a 503 until the models are in.
        loading = asyncio.ensure_future(models.start())
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await models.stop()

    app = FastAPI(title="slotserve", version="0.1.0", lifespan=lifespan)
    app.add_middleware(
        AccessMiddleware,
        policy=ctx.access,
        on_refused_key=lambda: ctx.count_error(401, "invalid_request_error"),
    )
    if ctx.cors is not None:  # outside the access rules: a preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ctx.access.allowed_origins),
            allow_methods=list(ctx.cors.methods or ("*",)),
            allow_headers=list(ctx.cors.headers or ("*",)),
            allow_credentials=ctx.cors.credentials,
        )
    # Before the access rules: a huge body is refused without reading it, authorized or not.
    app.add_middleware(
        BodyLimitMiddleware,
        limit=ctx.request_bytes_limit,
        on_refused=lambda: ctx.count_error(413, "invalid_request_error"),
    )
    if ctx.tracer is not None:  # inside the request id, which it names
        app.add_middleware(TracingMiddleware, tracer=ctx.tracer)
    app.add_middleware(RequestIdMiddleware)  # outermost: refusals carry the id too
    install_error_handlers(app, ctx.count_error)

    @app.post("/v1/chat/completions", responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw, request_id_of(raw))

    @app.post("/v1/completions", responses=_GENERATION_ERRORS)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw, request_id_of(raw))

    @app.post("/v1/embeddings", responses=_GENERATION_ERRORS)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await create_embeddings(ctx, body, raw, request_id_of(raw))

    # vLLM serves rerank at all three paths, score at two; clients use each.
    @app.post("/v1/rerank", responses=_GENERATION_ERRORS)
    @app.post("/v2/rerank", responses=_GENERATION_ERRORS)
    @app.post("/rerank", responses=_GENERATION_ERRORS)
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        return await create_rerank(ctx, body, raw, request_id_of(raw))

    @app.post("/v1/score", responses=_GENERATION_ERRORS)
    @app.post("/score", responses=_GENERATION_ERRORS)
    async def score(body: ScoreRequest, raw: Request) -> Response:
        return await create_score(ctx, body, raw, request_id_of(raw))

    response_store = ResponseStore()

    @app.post("/v1/responses", responses=_GENERATION_ERRORS)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, body, raw, request_id_of(raw), response_store)

    @app.get("/v1/responses/{response_id}", responses={404: {"model": ErrorResponse}})
    async def stored_response(response_id: str) -> Response:
        return get_response(response_store, response_id, ctx.count_error)

    @app.post("/v1/messages", responses=_MESSAGES_ERRORS)
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, body, raw, request_id_of(raw))

    @app.post("/v1/messages/count_tokens", responses=_MESSAGES_ERRORS)
    async def messages_count_tokens(body: CountTokensRequest, raw: Request) -> Response:
        return await count_tokens(ctx, body, raw)

    @app.post("/tokenize", responses=_TOKENIZATION_ERRORS)
    async def tokenize_route(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
        return await tokenize(ctx, body, raw)

    @app.post("/detokenize", responses=_TOKENIZATION_ERRORS)
    async def detokenize_route(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        return await detokenize(ctx, body, raw)

    app.include_router(model_routes(ctx))
    app.include_router(lora_routes(ctx))
    app.include_router(worker_routes(ctx))  # what the SGLang Model Gateway asks

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the server serves or can recover by itself (loading,
        draining); 503 when every model is unhealthy or failed to load (a reload is needed)."""
        hosts = list(models.hosts.values())
        states = [h.state for h in hosts]
        body: dict[str, Any] = {"status": "ok"}
        if len(hosts) == 1 and states[0] is not ModelState.READY:
            body = {"status": states[0].value, "reason": hosts[0].reason}
        elif any(s is not ModelState.READY for s in states):
            body["status"] = "degraded"
        if len(hosts) > 1:
            body["models"] = {h.name: h.state.value for h in hosts}
        broken = bool(states) and all(s in _BROKEN for s in states)
        return JSONResponse(body, 503 if broken else 200)

    @app.get("/ready")
    async def ready(model: str | None = None) -> JSONResponse:
        """Readiness: 200 when a generation request would be served now (by ``model``, or by
        some model once the start-up models are in)."""
        if model is not None or len(models.hosts) == 1:
            host = models.host(model)
            if host.state is ModelState.READY:
                return JSONResponse({"status": "ready"})
            return JSONResponse({"status": host.state.value, "reason": host.reason}, 503)
        if not models.startup_done.is_set():
            return JSONResponse({"status": "loading", "reason": "models are loading"}, 503)
        if any(h.state is ModelState.READY for h in models.hosts.values()) or (
            not models.hosts and models.autoload and models.available()
        ):
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "unavailable", "reason": "no model is ready"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


_BROKEN = (ModelState.UNHEALTHY, ModelState.FAILED)


def _engine_samples(ctx: ServingContext) -> list[tuple[str, EngineSample]]:
    return [
        (
            name,
            EngineSample(
                host.state.value,
                host.loads,
                host.model.stats if host.model is not None else None,
                host.totals(),
                host.restarts,
            ),
        )
        for name, host in list(ctx.models.hosts.items())
    ]


def _prefix_samples(ctx: ServingContext) -> list[tuple[str, PrefixCacheStats]]:
    return [(name, prefix_stats(host)) for name, host in list(ctx.models.hosts.items())]
