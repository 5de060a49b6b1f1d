"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API as a translation over
the chat-completions path.

A request becomes a chat request (the earlier turns of ``previous_response_id`` first), runs
through :func:`create_chat_completion` like any other, and its answer is turned back: the JSON
body into a response object, the chat SSE chunks into the Responses typed events. Everything
the chat path checks (model, length, sampling values, tools) it checks here too: its errors
reach the client as they are, but for ``param``, which names the Responses field."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Content

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.errors import ErrorCounter, error_response
from slotserve.server.openai.chat import create_chat_completion
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.responses.output import (
    assistant_turn,
    finished,
    new_id,
    output_items,
    response_shell,
)
from slotserve.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from slotserve.server.responses.store import ResponseStore, StoredResponse
from slotserve.server.responses.stream import ResponseEventStream
from slotserve.server.serving import ServingContext

# new_id("resp"): 16 random bytes as hex.
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
# Where a chat field came from in the Responses request, for the errors' "param".
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


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
    host, _ = await ctx.acquire(body.model, raw, body.keep_alive)
    shell = response_shell(body, new_id("resp"), int(time.time()), host.name)
    try:
        result = await create_chat_completion(ctx, chat, raw, http_request_id)
    except InvalidRequestError as exc:
        # The chat path names its own fields; the client sent the Responses ones.
        exc.param = _responses_param(exc.param)
        raise
    if result.status_code != 200:  # an error body or a client that left: as the chat path says
        return result
    if isinstance(result, StreamingResponse):
        stream = ResponseEventStream(shell)
        events = _events(result, stream, store if body.store else None, conversation)
        return StreamingResponse(events, media_type="text/event-stream")
    completion = json.loads(bytes(result.body))
    choice = completion["choices"][0]
    finish_reason = choice.get("finish_reason")
    output = output_items(choice.get("message") or {}, finish_reason)
    response = finished(shell, output, completion.get("usage"), finish_reason)
    if body.store:
        store.put(StoredResponse(response, [*conversation, assistant_turn(output)]))
    return JSONResponse(response)


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


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls (parallel calls) go into one
    assistant message, and a call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_request_of(
    body: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """Only the fields the client set are passed on, so the chat path's defaults apply."""
    fields: dict[str, Any] = {
        "model": body.model,
        "keep_alive": body.keep_alive,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "user": body.user,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    chat: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    chat["messages"] = messages
    if body.stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _responses_param(str((first.get("loc") or ("input",))[0]))
        raise InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param
        ) from None


def _responses_param(chat_param: str | None) -> str | None:
    # "messages.3.content" has no counterpart index in "input" (instructions and earlier
    # turns come first), so a renamed field is named without its path.
    head = (chat_param or "").split(".", 1)[0]
    return _CHAT_TO_RESPONSES.get(head, chat_param)


async def _events(
    chat: StreamingResponse,
    stream: ResponseEventStream,
    store: ResponseStore | None,
    conversation: list[dict[str, Any]],
) -> AsyncIterator[str]:
    """Runs the chat stream inside this generator, so a client that leaves ends (and aborts)
    both. The response is stored only when the chat stream reached its ``[DONE]``: without
    it the client left, and a cut-off answer must not become a turn to continue from."""
    for frame in stream.opening():
        yield frame
    async with contextlib.aclosing(_chat_chunks(chat.body_iterator)) as chunks:
        async for chunk in chunks:
            if chunk is None:
                for event in stream.complete():
                    yield event
                if store is not None and stream.response is not None:
                    turn = assistant_turn(stream.output)
                    store.put(StoredResponse(stream.response, [*conversation, turn]))
                return
            if "error" in chunk:
                for event in stream.fail(chunk["error"]):
                    yield event
                return
            for event in stream.feed(chunk):
                yield event


async def _chat_chunks(body: AsyncIterable[Content]) -> AsyncGenerator[dict[str, Any] | None, None]:
    """The chat stream's ``data:`` payloads, parsed; ``None`` for ``[DONE]``."""
    buffer = ""
    try:
        async for piece in body:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode("utf-8")
            while "\n\n" in buffer:
                frame, buffer = buffer.split("\n\n", 1)
                lines = [
                    line[5:].strip() for line in frame.splitlines() if line.startswith("data:")
                ]
                data = "\n".join(lines)
                if data:
                    yield None if data == "[DONE]" else json.loads(data)
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()
