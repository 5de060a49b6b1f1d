"""The FastAPI application: thin routes over :mod:`slotserve.server.serving_*` (SPEC S1-S4)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slotserve.server.errors import install_error_handlers
from slotserve.server.protocol import ChatCompletionRequest, CompletionRequest
from slotserve.server.serving import ServingContext, new_request_id
from slotserve.server.serving_chat import create_chat_completion
from slotserve.server.serving_completions import create_completion

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestIdMiddleware:
    """Gives every request an id (the client's ``x-request-id`` or a new one) and echoes it."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(ctx: ServingContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.shutdown()

    app = FastAPI(title="slotserve", lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw, new_request_id("chatcmpl"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw, new_request_id("cmpl"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = ctx.model_info
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.model_name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "slotserve",
                    "max_model_len": info.max_seq_len,
                    "runner": info.runner,
                    "slots": info.num_slots,
                    "state": "loaded" if ctx.engine.is_running else "unhealthy",
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = ctx.engine.is_running
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, 200 if ok else 503)

    @app.get("/v1/slots")
    async def slots() -> dict[str, Any]:
        stats = ctx.engine.core.stats
        return {
            "slots": [asdict(s) for s in stats.slots],
            "num_waiting": stats.num_waiting,
            "steps": stats.steps,
            "step_seconds": stats.step_seconds,
            "execute_seconds": stats.execute_seconds,
            "forward_seconds": ctx.engine.core.runner.forward_seconds,
            "generated_tokens": stats.generated_tokens,
            "requests_finished": stats.requests_finished,
            "requests_aborted": stats.requests_aborted,
            "requests_failed": stats.requests_failed,
        }

    @app.get("/v1/prefix_cache_stats")
    async def prefix_cache_stats() -> dict[str, Any]:
        # Reads the snapshot the engine thread published after its last step: never blocks it.
        stats = ctx.engine.core.stats
        return {
            **stats.prefix_cache.as_dict(),
            "integrity_checks": stats.integrity_checks,
            "integrity_failures": stats.integrity_failures,
            "last_integrity_error": stats.last_integrity_error,
        }

    return app
