"""The Responses API's response object and output items, built from what the chat path
returned: shared by the JSON and the streaming answers so the two cannot disagree."""

from __future__ import annotations

import secrets
import time
from typing import Any

from slotserve.server.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def response_shell(
    request: ResponsesRequest, response_id: str, created_at: int, model: str
) -> dict[str, Any]:
    """The response as announced before any output: ``status`` in_progress, no usage. The
    request's settings are echoed with the values the chat path applies when one is left out."""
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "store": request.store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": text or {"format": {"type": "text"}},
        "tool_choice": _tool_choice(request),
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def _tool_choice(request: ResponsesRequest) -> str | dict[str, Any]:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def finished(
    shell: dict[str, Any],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    """The final response. A chat ``length`` finish is OpenAI's ``incomplete`` with reason
    ``max_output_tokens``; an ``abort`` (server shutdown) is incomplete too, with that reason."""
    if finish_reason in ("length", "abort"):
        status = "incomplete"
        reason = "max_output_tokens" if finish_reason == "length" else finish_reason
        details: dict[str, Any] | None = {"reason": reason}
    else:
        status, details = "completed", None
    response = {**shell, "status": status, "incomplete_details": details, "output": output}
    response["usage"] = responses_usage(usage) if usage is not None else None
    if status == "completed":
        response["completed_at"] = int(time.time())
    return response


def failed(shell: dict[str, Any], output: list[dict[str, Any]], error: Any) -> dict[str, Any]:
    """The response a stream ends with when the chat path reported an error mid-way; the code
    is one of OpenAI's ``ResponseError`` codes, and the original type is kept beside it."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    status = error.get("code")
    body = {
        "code": "rate_limit_exceeded" if status == 429 else "server_error",
        "message": str(error.get("message") or "generation failed"),
        "type": error.get("type"),
        "param": error.get("param"),
    }
    return {**shell, "status": "failed", "output": output, "error": body}


def responses_usage(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses names; the chat names are kept too, as SGLang sends them."""
    prompt = int(chat.get("prompt_tokens") or 0)
    completion = int(chat.get("completion_tokens") or 0)
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """A chat message's reasoning, text and tool calls as output items, in the order the
    streamed answer produces them; the last one is incomplete when the output was cut."""
    items = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not (calls or items):  # an answer with nothing in it is still a message
        items.append(message_item(new_id("msg"), text, "completed"))
    for call in calls:
        function = call.get("function") or {}
        items.append(
            function_call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                function.get("name", ""),
                function.get("arguments") or "",
                "completed",
            )
        )
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's output as the assistant message a later turn replays. Reasoning is left
    out: chat templates drop earlier turns' reasoning too."""
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}
