"""One choice's generated text → typed events: thinking split off (``--reasoning-parser``),
then tool calls parsed out of the rest (the request's tool plan). The same work delta by delta
(a stream) or on the whole text (a JSON answer), so streamed pieces concatenate to exactly
the whole reply."""

from __future__ import annotations

from collections.abc import Sequence

from slotserve.protocol.reasoning import ReasoningParser, ReasoningStream
from slotserve.protocol.tool_parsers import (
    ContentDelta,
    ToolCallStream,
    ToolParser,
    make_call_id,
)
from slotserve.server.events import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)


def parse_reply(
    choice: int, text: str, tools: ToolParser | None, reasoning: ReasoningParser | None
) -> tuple[list[Event], bool]:
    """The events of a whole reply, one per piece, and whether it holds tool calls."""
    events: list[Event] = []
    if reasoning is not None:
        thought, text = reasoning.parse(text)
        if thought:
            events.append(ReasoningDelta(choice, thought))
    calls = []
    if tools is not None:
        parsed = tools.parse(text)
        text, calls = parsed.content, parsed.tool_calls
    if text:
        events.append(TextDelta(choice, text))
    for index, call in enumerate(calls):
        events.append(ToolCallStart(choice, index, call.id, call.name))
        events.append(ToolCallArguments(choice, index, call.arguments))
        events.append(ToolCallEnd(choice, index))
    return events, bool(calls)


class ReplyParser:
    """Streaming: text deltas in, events out; a call ends (:class:`ToolCallEnd`) when anything
    else of the choice comes, or at the end."""

    def __init__(
        self, choice: int, tools: ToolParser | None, reasoning: ReasoningParser | None
    ) -> None:
        self._choice = choice
        self._reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._tools: ToolCallStream | None = tools.stream() if tools else None
        self._ids: dict[int, str] = {}
        self._open_call: int | None = None
        self.has_calls = False

    def feed(self, text: str) -> list[Event]:
        if self._reasoning is None:
            return self._content(text, final=False)
        return self._split(self._reasoning.feed(text), final=False)

    def finish(self) -> list[Event]:
        if self._reasoning is None:
            events = self._content("", final=True)
        else:
            events = self._split(self._reasoning.finish(), final=True)
        return events + self._end_call()

    def _split(self, pieces: Sequence[tuple[str, str]], final: bool) -> list[Event]:
        events: list[Event] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                events += self._end_call()
                events.append(ReasoningDelta(self._choice, piece))
            else:
                events += self._content(piece, final=False)
        if final:
            events += self._content("", final=True)
        return events

    def _content(self, text: str, final: bool) -> list[Event]:
        if self._tools is None:
            return [TextDelta(self._choice, text)] if text else []
        found = self._tools.feed(text) if text else []
        if final:
            found += self._tools.finish()
        events: list[Event] = []
        for event in found:
            if isinstance(event, ContentDelta):
                if event.text:
                    events += self._end_call()
                    events.append(TextDelta(self._choice, event.text))
                continue
            self.has_calls = True
            if event.id is None and event.name is None:
                events.append(ToolCallArguments(self._choice, event.index, event.arguments))
                continue
            # One id per call whatever the parser made: its first delta carries it.
            call_id = self._ids.setdefault(event.index, event.id or make_call_id())
            events += self._end_call()
            events.append(ToolCallStart(self._choice, event.index, call_id, event.name or ""))
            self._open_call = event.index
            if event.arguments:
                events.append(ToolCallArguments(self._choice, event.index, event.arguments))
        return events

    def _end_call(self) -> list[Event]:
        index, self._open_call = self._open_call, None
        return [] if index is None else [ToolCallEnd(self._choice, index)]
