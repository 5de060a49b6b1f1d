"""One chat choice's generated text → the assistant message OpenAI clients read: thinking split
off into ``reasoning_content`` (``--reasoning-parser``), then tool calls parsed out of the rest
(``tool_calling.py``). The same work whole (non-streaming) or delta by delta (streaming), so
streamed pieces concatenate to exactly the non-streamed message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slotserve.protocol.reasoning import ReasoningParser, ReasoningStream
from slotserve.protocol.tool_parsers import ContentDelta, ToolCallStream, make_call_id
from slotserve.server.openai.tool_calling import ToolPlan


def finish_reason_of(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: ``tool_calls`` when the model ended on calls it chose to make (never with
    an empty list); a forced named function keeps ``stop``."""
    if has_calls and reason == "stop" and not plan.named:
        return "tool_calls"
    return reason


def message_of(
    text: str, plan: ToolPlan, reasoning: ReasoningParser | None
) -> tuple[dict[str, Any], bool]:
    """The assistant message for a whole reply, and whether it holds tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        thought, text = reasoning.parse(text)
        message["reasoning_content"] = thought
        message["content"] = text
    if plan.parser is None:
        return message, False
    parsed = plan.parser.parse(text)
    if not parsed.tool_calls:
        message["content"] = parsed.content
        return message, False
    message["content"] = parsed.content or None
    message["tool_calls"] = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in parsed.tool_calls
    ]
    return message, True


class DeltaShaper:
    """Streaming: text deltas in, ``delta`` objects of ``chat.completion.chunk`` out."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self._reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._tools: ToolCallStream | None = plan.parser.stream() if plan.parser else None
        self._ids: dict[int, str] = {}
        self.has_calls = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content(text, final=False)
        return self._split(self._reasoning.feed(text), final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content("", final=True)
        return self._split(self._reasoning.finish(), final=True)

    def _split(self, pieces: Sequence[tuple[str, str]], final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning_content": piece})
            else:
                deltas += self._content(piece, final=False)
        if final:
            deltas += self._content("", final=True)
        return deltas

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._tools is None:
            return [{"content": text}] if text else []
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                if event.text:
                    deltas.append({"content": event.text})
                continue
            self.has_calls = True
            call: dict[str, Any] = {"index": event.index, "function": {}}
            if event.id is not None or event.name is not None:
                # One id per call whatever the parser made: the first delta carries it.
                call_id = self._ids.setdefault(event.index, event.id or make_call_id())
                call.update(id=call_id, type="function")
                call["function"]["name"] = event.name
            call["function"]["arguments"] = event.arguments
            deltas.append({"tool_calls": [call]})
        return deltas
