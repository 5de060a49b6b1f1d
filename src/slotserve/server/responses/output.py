"""The Responses API's response object and output items, built from the pipeline's events
(``server/events.py``): shared by the JSON and the streaming answers so the two cannot
disagree."""

from __future__ import annotations

import base64
import binascii
import secrets
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from slotserve.server.events import Reply, Usage
from slotserve.server.responses.protocol import ResponsesRequest
from slotserve.server.responses.tools import ToolNames, call_input, flat_name, wrapped_input

# The server keeps no secret, so "encrypted" reasoning is an opaque encoding of its text that
# this server reads back when a client returns the item (Codex with ``store: false`` does):
# a marker, then the text compressed and base64url-encoded. It hides nothing from whoever
# holds it; it only keeps the text out of the client's way, as OpenAI's does.
_REASONING_MARK = "slotserve.reasoning.v1:"


def encode_reasoning(text: str) -> str:
    packed = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8")))
    return _REASONING_MARK + packed.decode("ascii")


def decode_reasoning(blob: str) -> str | None:
    """The text of our own encoding; None for anything else (another server's content)."""
    if not blob.startswith(_REASONING_MARK):
        return None
    try:
        raw = zlib.decompress(base64.urlsafe_b64decode(blob[len(_REASONING_MARK) :]))
        return raw.decode("utf-8")
    except (binascii.Error, zlib.error, ValueError):
        return None


@dataclass(frozen=True)
class OutputOptions:
    """How a reply becomes output items: the tool names to map calls back through, whether
    reasoning carries ``encrypted_content``, and how sampled tokens read as logprobs (None:
    no logprobs were asked for)."""

    names: ToolNames = field(default_factory=ToolNames)
    encrypted_reasoning: bool = False
    logprobs: Callable[[list[SampledToken]], list[dict[str, Any]]] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def response_shell(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    defaults: SamplingDefaults = NEUTRAL,
) -> dict[str, Any]:
    """The response as announced before any output: ``status`` in_progress, no usage. The
    request's settings are echoed with the values generation applies when one is left out
    (``defaults``: the model's in force)."""
    sampling = SamplingDefaults(temperature=request.temperature, top_p=request.top_p)
    applied = sampling.params(defaults)
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
        "temperature": applied["temperature"],
        "text": text or {"format": {"type": "text"}},
        "tool_choice": _tool_choice(request),
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in request.tools or []],
        "top_p": applied["top_p"],
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "metadata": request.metadata or {},
        "max_tool_calls": request.max_tool_calls,
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        # One local server has one way of serving a request.
        "service_tier": "default",
        "top_logprobs": request.top_logprobs,
        "background": False,
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
        # The prompt tokens computed afresh are what this request adds to the prefix cache.
        "input_tokens_details": {
            "cached_tokens": totals.cached_tokens,
            "cache_write_tokens": totals.prompt_tokens - totals.cached_tokens,
        },
        "output_tokens": totals.completion_tokens,
        # Thinking is not counted apart from the rest of the output.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": totals.total_tokens,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
    }


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def reasoning_item(item_id: str, text: str, status: str, encrypted: bool) -> dict[str, Any]:
    """The thinking in full as ``reasoning_text`` (as OpenAI's open-weight models return it);
    no summary, since no model here writes one."""
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }
    if encrypted:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def call_item(
    names: ToolNames, item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """The model's call to a name it was offered, as the item of the tool behind the name: a
    ``function_call`` (with its ``namespace`` when it came from one) or a
    ``custom_tool_call``."""
    ref = names.ref(name)
    item: dict[str, Any] = {"id": item_id, "call_id": call_id, "name": ref.name}
    if ref.kind == "custom":
        item |= {"type": "custom_tool_call", "input": call_input(arguments), "status": status}
    else:
        item |= {"type": "function_call", "arguments": arguments, "status": status}
    if ref.namespace is not None:
        item["namespace"] = ref.namespace
    return item


def output_items(
    reply: Reply, finish_reason: str | None, options: OutputOptions | None = None
) -> list[dict[str, Any]]:
    """A reply's reasoning, text and tool calls as output items, in the order the streamed
    answer produces them; the last one is incomplete when the output was cut."""
    options = options or OutputOptions()
    items = []
    if reply.reasoning:
        items.append(
            reasoning_item(new_id("rs"), reply.reasoning, "completed", options.encrypted_reasoning)
        )
    if reply.content or not (reply.tool_calls or items):  # an empty answer is still a message
        # The message's logprobs are all the reply's tokens': the parser's split of thinking
        # and calls from text is not kept per token.
        scores = options.logprobs(reply.logprobs) if options.logprobs else None
        items.append(message_item(new_id("msg"), reply.content, "completed", scores))
    for call in reply.tool_calls:
        items.append(
            call_item(options.names, new_id("fc"), call.id, call.name, call.arguments, "completed")
        )
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's output as the assistant message a later turn replays, its calls named
    as the model was offered them. Reasoning is left out: chat templates drop earlier turns'
    reasoning too."""
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
            "function": {
                "name": flat_name(item["name"], item.get("namespace")),
                "arguments": item["arguments"]
                if item["type"] == "function_call"
                else wrapped_input(item["input"]),
            },
        }
        for item in output
        if item["type"] in ("function_call", "custom_tool_call")
    ]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}
