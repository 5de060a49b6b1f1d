"""POST /v1/chat/completions: the request through the chat pipeline (``pipeline.py``), its
events rendered as a ``chat.completion`` or a stream of chunks (``chat_render.py``)."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from slotserve.server.openai.chat_prompt import start_chat
from slotserve.server.openai.chat_render import ChatChunks, chat_chunks, chat_completion
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.openai.shapes import Envelope, ended_on_failure
from slotserve.server.serving import ServingContext, served_name


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: Request, http_request_id: str
) -> Response:
    body.reject_unsupported()
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    generation = await start_chat(host, model, body, raw, http_request_id)
    created = int(time.time())
    if body.stream:
        envelope = Envelope(
            generation.request_id,
            "chat.completion.chunk",
            created,
            served_name(host, raw),
            body.include_usage,
        )
        chunks = ChatChunks(envelope, model.tokenizer, generation.num_choices)
        return StreamingResponse(
            ended_on_failure(chat_chunks(generation, chunks)), media_type="text/event-stream"
        )
    events = await generation.collect()
    if generation.disconnected:
        return Response(status_code=499)
    envelope = Envelope(generation.request_id, "chat.completion", created, served_name(host, raw))
    return JSONResponse(chat_completion(generation, events, body, model.tokenizer, envelope))
