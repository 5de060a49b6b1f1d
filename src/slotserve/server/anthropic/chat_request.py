"""A Messages request as the chat request the pipeline runs: the system prompt and the content
blocks as chat messages, the Anthropic fields under their chat names. The chat request's
validation names chat fields; :func:`anthropic_param` names the field the client sent."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from slotserve.engine.errors import InvalidRequestError
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.server.anthropic.protocol import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from slotserve.server.openai.protocol import ChatCompletionRequest

# Where a chat field came from in the Messages request, for the errors' "param".
_CHAT_TO_ANTHROPIC = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
}

# A failed tool run is told to the model in the result's text: chat templates have no field
# for it.
ERROR_PREFIX = "Error: "


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The system prompt, then each message's blocks in order: a user's tool results become
    tool messages (before its text, where Anthropic puts them), an assistant's tool uses its
    tool calls, its thinking the reasoning the templates leave out of the prompt."""
    messages: list[dict[str, Any]] = []
    system = body.system
    if system:
        text = system if isinstance(system, str) else "\n\n".join(b.text for b in system)
        messages.append({"role": "system", "content": text})
    for message in body.messages:
        messages += _converted(message)
    return messages


def _converted(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = message.content
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        if calls:
            turn |= {"content": text or None, "tool_calls": calls}
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            turn["reasoning_content"] = thinking
        return [turn]
    out: list[dict[str, Any]] = [
        {
            "role": "tool",
            "tool_call_id": b.tool_use_id,
            "content": (ERROR_PREFIX if b.is_error else "") + b.text(),
        }
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    if any(isinstance(b, ImageBlock) for b in blocks):
        parts = [
            {"type": "image_url", "image_url": {"url": b.url}}
            if isinstance(b, ImageBlock)
            else {"type": "text", "text": b.text}
            for b in blocks
            if isinstance(b, ImageBlock | TextBlock)
        ]
        out.append({"role": message.role, "content": parts})
    elif text or not out:
        out.append({"role": message.role, "content": text})
    return out


def chat_request_of(
    body: CountTokensRequest, template: ChatTemplate | None, stream: bool = False
) -> ChatCompletionRequest:
    """Only the fields the client set are passed on, so the chat path's defaults apply.
    ``template`` (when the model has one) says whether turning thinking off can reach it."""
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if isinstance(body, MessagesRequest):
        fields: dict[str, Any] = {
            "keep_alive": body.keep_alive,
            "priority": body.priority,
            "max_completion_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences or None,
            "user": body.metadata.user_id if body.metadata else None,
        }
        chat |= {k: v for k, v in fields.items() if v is not None}
        if stream:
            chat |= {"stream": True, "stream_options": {"include_usage": True}}
    tools = [t for t in body.tools or [] if isinstance(t, Tool) and not t.defer_loading]
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                    "strict": t.strict,
                },
            }
            for t in tools
        ]
    choice = body.tool_choice
    if choice is not None and (tools or choice.type != "none"):
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
        chat["tool_choice"] = mapped or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        schema = {"name": "output", "schema": fmt.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    thinking = body.thinking
    if (
        thinking is not None
        and thinking.type == "disabled"
        and template is not None
        and "enable_thinking" in template.source
    ):
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = anthropic_param(".".join(str(p) for p in first.get("loc") or ("messages",)))
        raise InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param
        ) from None


def anthropic_param(chat_param: str | None) -> str | None:
    head = (chat_param or "").split(".", 1)[0]
    if head in ("messages", "tools", "tool_choice"):
        # A chat message's index has no counterpart among Anthropic's messages (the system
        # prompt and tool results are messages of their own there).
        return head
    return _CHAT_TO_ANTHROPIC.get(head, chat_param)
