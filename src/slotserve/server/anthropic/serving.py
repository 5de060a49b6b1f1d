"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the
chat pipeline (``server/pipeline.py``).

A request becomes a chat request (``chat_request.py``) and runs through the pipeline like any
chat request; its events are rendered as a message (``output.py``) or Anthropic's stream of
events (``stream.py``). Errors are written in Anthropic's shape by the error handlers
(``server/errors.py``), which pick it by path; ``param`` names the Anthropic field."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import LoadedModel
from slotserve.server.anthropic.chat_request import anthropic_param, chat_request_of
from slotserve.server.anthropic.output import message, new_id
from slotserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from slotserve.server.anthropic.stream import MessageEventStream
from slotserve.server.errors import (
    ApiError,
    GenerationFailed,
    anthropic_error_type,
    failure_error,
)
from slotserve.server.events import fold
from slotserve.server.openai.chat_prompt import render_chat_off_loop, start_chat
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.pipeline import ChatGeneration
from slotserve.server.serving import ServingContext, large_body, served_name

# The engine ends a request with "abort" when the server shuts down under it.
_SHUTDOWN = "The request was ended because the server is shutting down; retry it."


async def create_message(
    ctx: ServingContext, body: MessagesRequest, raw: Request, http_request_id: str
) -> Response:
    body.reject_unsupported()
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    chat = _chat_request(model, body, stream=body.stream)
    _require_reasoning_parser(host, body)
    try:
        generation = await start_chat(host, model, chat, raw, http_request_id)
    except InvalidRequestError as exc:
        exc.param = anthropic_param(exc.param)
        raise
    message_id = new_id("msg")
    show_thinking = not (body.thinking is not None and body.thinking.display == "omitted")
    if body.stream:
        stream = MessageEventStream(
            message_id,
            served_name(host, raw),
            generation.num_prompt_tokens,
            body.stop_sequences,
            show_thinking,
        )
        return StreamingResponse(_events(generation, stream), media_type="text/event-stream")
    events = await generation.collect()
    if generation.disconnected:
        return Response(status_code=499)
    (reply,), totals = fold(events, 1)
    assert totals is not None, "a finished run ends with its usage"
    if reply.finish_reason == "abort":
        return ApiError(503, _SHUTDOWN, "service_unavailable").response(anthropic=True)
    name = served_name(host, raw)
    answer = message(message_id, name, reply, totals, body.stop_sequences, show_thinking)
    return JSONResponse(answer)


async def count_tokens(ctx: ServingContext, body: CountTokensRequest, raw: Request) -> Response:
    """The input tokens of the prompt ``create_message`` would submit: rendered the same way
    (system prompt, tools, template), counted before any cache is consulted."""
    body.reject_unsupported()
    host, model = await ctx.acquire(body.model, raw)
    chat = _chat_request(model, body)
    try:
        prompt, _, _ = await render_chat_off_loop(
            host, model, chat, large_body(raw), check_length=False
        )
    except InvalidRequestError as exc:
        exc.param = anthropic_param(exc.param)
        raise
    return JSONResponse({"input_tokens": len(prompt)})


def _chat_request(
    model: LoadedModel, body: CountTokensRequest, stream: bool = False
) -> ChatCompletionRequest:
    chat = chat_request_of(body, model.chat_template, stream)
    try:
        chat.reject_unsupported()
    except InvalidRequestError as exc:
        exc.param = anthropic_param(exc.param)
        raise
    return chat


def _require_reasoning_parser(host: ModelHost, body: MessagesRequest) -> None:
    # "adaptive" lets the model decide, and without a parser it does not think; "enabled"
    # asks for thinking blocks, which only a reasoning parser can split off.
    thinking = body.thinking
    if thinking is not None and thinking.type == "enabled" and host.launch.reasoning_parser is None:
        raise InvalidRequestError(
            "thinking.type 'enabled' needs the server to split thinking from the answer: "
            "start it with --reasoning-parser.",
            param="thinking",
        )


async def _events(generation: ChatGeneration, stream: MessageEventStream) -> AsyncIterator[str]:
    """The pipeline runs inside this generator, so a client that leaves ends (and aborts)
    it."""
    try:
        async with contextlib.aclosing(generation.frames(stream)) as frames:
            async for frame in frames:
                yield frame
    except GenerationFailed as exc:
        status, text, _, _ = failure_error(exc.output, generation.request_id, exc.timeout_s)
        for frame in stream.fail(anthropic_error_type(status), text):
            yield frame
        return
    if generation.disconnected:
        return
    if stream.finish is not None and stream.finish.reason == "abort":
        for frame in stream.fail(anthropic_error_type(503), _SHUTDOWN):
            yield frame
        return
    for frame in stream.complete():
        yield frame
