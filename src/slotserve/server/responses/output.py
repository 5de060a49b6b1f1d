"""The Responses API's response object and output items, built from the pipeline's events
(``server/events.py``): shared by the JSON and the streaming answers so the two cannot
disagree."""

from __future__ import annotations

import secrets
import time
from typing import Any

from slotserve.server.events import Reply, Usage
from slotserve.server.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def response_shell(
    request: ResponsesRequest, response_id: str, created_at: int, model: str
) -> dict[str, Any]:
    """The response as announced before any output: ``status`` in_progress, no usage. The
    request's settings are echoed with the values generation applies when one is left out."""
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
    usage: Usage | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    """The final response. A ``length`` finish is OpenAI's ``incomplete`` with reason
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
    """The response a stream ends with when generation failed mid-way (``error`` as a stream's
    error frame has it); the code is one of OpenAI's ``ResponseError`` codes, and the original
    type is kept beside it."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    status = error.get("code")
    body = {
        "code": "rate_limit_exceeded" if status == 429 else "server_error",
        "message": str(error.get("message") or "generation failed"),
        "type": error.get("type"),
        "param": error.get("param"),
    }
    return {**shell, "status": "failed", "output": output, "error": body}


def responses_usage(totals: Usage) -> dict[str, Any]:
    """Usage in the Responses names; the chat names are kept too, as SGLang sends them."""
    return {
        "input_tokens": totals.prompt_tokens,
        "input_tokens_details": {"cached_tokens": totals.cached_tokens},
        "output_tokens": totals.completion_tokens,
        # Thinking is not counted apart from the rest of the output.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": totals.total_tokens,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
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


def output_items(reply: Reply, finish_reason: str | None) -> list[dict[str, Any]]:
    """A reply's reasoning, text and tool calls as output items, in the order the streamed
    answer produces them; the last one is incomplete when the output was cut."""
    items = []
    if reply.reasoning:
        items.append(reasoning_item(new_id("rs"), reply.reasoning, "completed"))
    if reply.content or not (reply.tool_calls or items):  # an empty answer is still a message
        items.append(message_item(new_id("msg"), reply.content, "completed"))
    for call in reply.tool_calls:
        items.append(
            function_call_item(new_id("fc"), call.id, call.name, call.arguments, "completed")
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
