"""A Responses request as the chat request the pipeline runs: the input items as chat
messages, the Responses fields under their chat names. The chat request's validation and the
pipeline's checks name chat fields; :func:`responses_param` names the Responses field the
client sent instead."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
)

# Where a chat field came from in the Responses request, for the errors' "param".
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


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
        param = responses_param(str((first.get("loc") or ("input",))[0]))
        raise InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param
        ) from None


def responses_param(chat_param: str | None) -> str | None:
    # "messages.3.content" has no counterpart index in "input" (instructions and earlier
    # turns come first), so a renamed field is named without its path.
    head = (chat_param or "").split(".", 1)[0]
    return _CHAT_TO_RESPONSES.get(head, chat_param)
