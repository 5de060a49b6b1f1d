"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat
pipeline (``server/pipeline.py``).

A request becomes a chat request (``chat_request.py``; the earlier turns of
``previous_response_id`` first) and runs through the pipeline like any chat request; its events
are rendered as a response object (``output.py``) or the Responses typed events
(``stream.py``). Everything the chat path checks (model, length, sampling values, tools) it
checks here too, with errors that name the Responses field in ``param``."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from slotserve.engine.core.limits import CONTEXT_LENGTH_EXCEEDED
from slotserve.engine.errors import InvalidRequestError
from slotserve.hosting.served import LoadedModel
from slotserve.server.errors import ErrorCounter, GenerationFailed, error_response, stream_error
from slotserve.server.events import fold
from slotserve.server.openai.chat_prompt import start_chat
from slotserve.server.openai.shapes import chat_logprobs
from slotserve.server.pipeline import ChatGeneration
from slotserve.server.responses.chat_request import (
    chat_request_of,
    input_messages,
    responses_param,
    wants_logprobs,
)
from slotserve.server.responses.output import (
    OutputOptions,
    assistant_turn,
    finished,
    new_id,
    output_items,
    response_shell,
)
from slotserve.server.responses.protocol import ResponsesRequest
from slotserve.server.responses.store import ResponseStore, StoredResponse
from slotserve.server.responses.stream import ResponseEventStream
from slotserve.server.responses.tools import chat_tools
from slotserve.server.serving import ServingContext, served_name

# Where a prompt too long for a slot is told how to make room.
_CONTEXT_HINT = (
    " Each slot holds --ctx-size / --slots tokens (llama.cpp; --max-model-len on the PyTorch "
    "runner): restart the server with a larger --ctx-size or fewer --slots."
)

# new_id("resp"): 16 random bytes as hex.
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


async def create_response(
    ctx: ServingContext,
    body: ResponsesRequest,
    raw: Request,
    http_request_id: str,
    store: ResponseStore,
) -> Response:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = _lookup(store, body.previous_response_id, "previous_response_id")
        if previous is None:
            ctx.count_error(404, "invalid_request_error")
            return _not_found(body.previous_response_id, "previous_response_id")
        history = previous.messages
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = chat_request_of(body, system + conversation)
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    shell = response_shell(
        body, new_id("resp"), int(time.time()), served_name(host, raw), model.sampling_defaults
    )
    try:
        generation = await start_chat(host, model, chat, raw, http_request_id)
    except InvalidRequestError as exc:
        # The pipeline names the chat fields; the client sent the Responses ones.
        exc.param = responses_param(exc.param)
        if exc.code == CONTEXT_LENGTH_EXCEEDED:
            exc.message += _CONTEXT_HINT
            if body.truncation == "auto":
                exc.message += " (truncation 'auto' is not done by this server.)"
            exc.args = (exc.message,)
        raise
    options = _output_options(body, model)
    # store false: nothing is kept, so no later request can name this response.
    kept = store if body.store else None
    if body.stream:
        stream = ResponseEventStream(shell, options)
        frames = _events(generation, stream, kept, conversation)
        return StreamingResponse(frames, media_type="text/event-stream")
    events = await generation.collect()
    if generation.disconnected:
        return Response(status_code=499)
    (reply,), totals = fold(events, 1)
    output = output_items(reply, reply.finish_reason, options)
    response = finished(shell, output, totals, reply.finish_reason)
    if kept is not None:
        kept.put(StoredResponse(response, [*conversation, assistant_turn(output)]))
    return JSONResponse(response)


def _output_options(body: ResponsesRequest, model: LoadedModel) -> OutputOptions:
    tokenizer = model.tokenizer
    return OutputOptions(
        names=chat_tools(body)[1],
        encrypted_reasoning=body.includes("reasoning.encrypted_content"),
        logprobs=(lambda tokens: chat_logprobs(tokenizer, tokens)["content"])
        if wants_logprobs(body)
        else None,
    )


def get_response(
    store: ResponseStore, response_id: str, count: ErrorCounter | None = None
) -> Response:
    stored = _lookup(store, response_id, "response_id")
    if stored is None:
        if count is not None:
            count(404, "invalid_request_error", None)
        return _not_found(response_id, "response_id")
    return JSONResponse(stored.response)


def _lookup(store: ResponseStore, response_id: str, param: str) -> StoredResponse | None:
    if not _RESPONSE_ID.fullmatch(response_id):
        raise InvalidRequestError(
            f"Invalid '{param}': '{response_id}' is not a response id of this server "
            "(expected 'resp_' and 32 hex digits).",
            param=param,
            code="invalid_value",
        )
    return store.get(response_id)


def _not_found(response_id: str, param: str) -> JSONResponse:
    # Stored responses live in memory: a restart or newer responses may have dropped it.
    what = "Previous response" if param == "previous_response_id" else "Response"
    message = f"{what} with id '{response_id}' not found (it may have been evicted)."
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return error_response(404, message, "invalid_request_error", param, code)


async def _events(
    generation: ChatGeneration,
    stream: ResponseEventStream,
    store: ResponseStore | None,
    conversation: list[dict[str, Any]],
) -> AsyncIterator[str]:
    """The pipeline runs inside this generator, so a client that leaves ends (and aborts)
    it. The response is stored only when the run went to the end: otherwise the client left,
    and a cut-off answer must not become a turn to continue from."""
    try:
        async with contextlib.aclosing(generation.frames(stream)) as frames:
            async for frame in frames:
                yield frame
    except GenerationFailed as exc:
        for frame in stream.fail(stream_error(exc)["error"]):
            yield frame
        return
    if generation.disconnected:
        return
    for frame in stream.complete():
        yield frame
    if store is not None and stream.response is not None:
        store.put(StoredResponse(stream.response, [*conversation, assistant_turn(stream.output)]))
