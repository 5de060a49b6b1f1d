"""A Responses request as the chat request the pipeline runs: the input items as chat
messages, the Responses fields under their chat names. The chat request's validation and the
pipeline's checks name chat fields; :func:`responses_param` names the Responses field the
client sent instead."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.responses.output import decode_reasoning
from slotserve.server.responses.protocol import (
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from slotserve.server.responses.tools import chat_tool_choice, chat_tools, flat_name, wrapped_input

# Where a chat field came from in the Responses request, for the errors' "param".
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive calls (parallel calls) go into one assistant
    message, a call's output is a tool message, and a reasoning item becomes the
    ``reasoning_content`` of the assistant message after it (templates that know it show it;
    one with no assistant turn after it is dropped). Calls are named as the model was offered
    them (``tools.py``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant(fresh: bool) -> dict[str, Any]:
        last = messages[-1] if messages else None
        if fresh or last is None or last["role"] != "assistant" or reasoning:
            last = {"role": "assistant", "content": None}
            if reasoning:
                last["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            messages.append(last)
        return last

    for item in items:
        if isinstance(item, MessageItem):
            if item.role == "assistant":
                assistant(fresh=True)["content"] = item.text()
            else:
                reasoning.clear()
                messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, ReasoningItem):
            text = _reasoning_text(item)
            if text:
                reasoning.append(text)
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            name = flat_name(item.name, item.namespace)
            arguments = (
                item.arguments if isinstance(item, FunctionCallItem) else wrapped_input(item.input)
            )
            function = {"name": name, "arguments": arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            assistant(fresh=False).setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            reasoning.clear()
            call_id = item.call_id
            if call_id is None:  # an output that answers no call: named by its tool
                assert isinstance(item, FunctionCallOutputItem)
                call_id = flat_name(item.name or "tool", item.namespace)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": item.text()})
    return messages


def _reasoning_text(item: ReasoningItem) -> str:
    """The thinking a reasoning item carries: its full text, else what its encrypted content
    decodes to (ours; another server's cannot be read and is dropped), else its summary."""
    if item.content:
        return "".join(part.text for part in item.content)
    if item.encrypted_content:
        decoded = decode_reasoning(item.encrypted_content)
        if decoded is not None:
            return decoded
    return "\n".join(part.text for part in item.summary)


def chat_request_of(
    body: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """Only the fields the client set are passed on, so the chat path's defaults apply."""
    fields: dict[str, Any] = {
        "model": body.model,
        "keep_alive": body.keep_alive,
        "priority": body.priority,
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
    if wants_logprobs(body):
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    tools, _ = chat_tools(body)
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body, tools)
    if choice is not None:
        chat["tool_choice"] = choice
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


def wants_logprobs(body: ResponsesRequest) -> bool:
    return body.top_logprobs is not None or body.includes("message.output_text.logprobs")


def responses_param(chat_param: str | None) -> str | None:
    # "messages.3.content" has no counterpart index in "input" (instructions and earlier
    # turns come first), so a renamed field is named without its path.
    head = (chat_param or "").split(".", 1)[0]
    return _CHAT_TO_RESPONSES.get(head, chat_param)
