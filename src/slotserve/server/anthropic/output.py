"""The Messages API's message object, its content blocks, stop reason and usage, built from the
pipeline's events (``server/events.py``): shared by the JSON and the streaming answers so the
two cannot disagree."""

from __future__ import annotations

import json
import secrets
from typing import Any

from slotserve.server.events import ChoiceFinished, Reply, Usage

# Thinking blocks must carry a signature; ours is opaque and never checked, because earlier
# turns' thinking never reaches the prompt again.
SIGNATURE = ""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def tool_use_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def message_shell(message_id: str, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The message as a stream announces it: no content, no stop reason yet."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def anthropic_usage(totals: Usage) -> dict[str, int]:
    """Anthropic's convention: ``input_tokens`` are the prompt tokens not read from the
    cache, so the whole input is ``input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens``; the prefix cache fills itself, so nothing counts as a
    cache write."""
    return {
        "input_tokens": totals.prompt_tokens - totals.cached_tokens,
        "output_tokens": totals.completion_tokens,
        "cache_read_input_tokens": totals.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason_of(
    finish: ChoiceFinished | None, stop_sequences: list[str] | None
) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``; a cut-off call is ``max_tokens``, not ``tool_use``."""
    if finish is not None and finish.reason == "length":
        return "max_tokens", None
    if finish is not None and finish.tool_calls:
        return "tool_use", None
    stop = finish.stop if finish is not None else None
    if isinstance(stop, str) and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object; text that is not a JSON object (an output
    cut off mid-call) becomes an empty one rather than an error after the fact."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(reply: Reply, show_thinking: bool) -> list[dict[str, Any]]:
    """Thinking, text, then tool uses: the order the streamed answer produces them."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        thinking = reply.reasoning if show_thinking else ""
        blocks.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": tool_input(call.arguments),
            }
        )
    return blocks


def message(
    message_id: str,
    model: str,
    reply: Reply,
    totals: Usage,
    stop_sequences: list[str] | None,
    show_thinking: bool,
) -> dict[str, Any]:
    """The whole message of a run that went to the end."""
    reason, sequence = stop_reason_of(reply.finish, stop_sequences)
    shell = message_shell(message_id, model, anthropic_usage(totals))
    content = content_blocks(reply, show_thinking)
    return {**shell, "content": content, "stop_reason": reason, "stop_sequence": sequence}
