"""Where a parser's events go: released at once, or held while a call section is undecided.

A *section* is the stretch of output a format treats as one unit of calls (a hermes
``<tool_call>`` block, a mistral ``[TOOL_CALLS]`` list, the whole of a llama3 or generic
output). Its events are speculative until the section is committed. A streaming parser
releases them at the end of every ``feed`` (a client wants argument fragments as they come);
a whole-text parse keeps them until the section is decided, so a section that fails leaves no
trace but its raw text, given back as content.
"""

from __future__ import annotations

from slotserve.protocol.tool_parsers.base import (
    ContentDelta,
    ParsedMessage,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    make_call_id,
)


class EventSink:
    def __init__(self, whole: bool) -> None:
        self._whole = whole
        self._released: list[StreamEvent] = []
        self._held: list[StreamEvent] = []
        self._open = False
        self._first_index = 0
        self._calls_shown = False
        self._next_index = 0

    @property
    def in_section(self) -> bool:
        return self._open

    def content(self, text: str) -> None:
        if text:
            self._target().append(ContentDelta(text))

    def start_call(self, name: str) -> int:
        index = self._next_index
        self._next_index += 1
        self._target().append(ToolCallDelta(index, make_call_id(), name, ""))
        return index

    def arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._target().append(ToolCallDelta(index, None, None, fragment))

    def open_section(self) -> None:
        assert not self._open, "sections do not nest"
        self._open = True
        self._first_index = self._next_index
        self._calls_shown = False

    def commit(self) -> None:
        self._released += self._held
        self._held = []
        self._open = False

    def fail(self, raw: str) -> None:
        """The section made no call after all: its raw text becomes content."""
        self._held = []
        if not self._calls_shown:
            # Indices a client never saw are free again, so the next call is still index 0.
            self._next_index = self._first_index
        self._open = False
        self.content(raw)

    def take(self, final: bool = False) -> list[StreamEvent]:
        assert not (final and self._open), "finish() must decide the open section"
        if not self._whole and self._held:
            self._calls_shown = self._calls_shown or any(
                isinstance(e, ToolCallDelta) for e in self._held
            )
            self._released += self._held
            self._held = []
        events = coalesce(self._released)
        self._released = []
        return events

    def _target(self) -> list[StreamEvent]:
        return self._held if self._open else self._released


def coalesce(events: list[StreamEvent]) -> list[StreamEvent]:
    """Joins neighbouring content, and neighbouring argument fragments of one call; a call's
    first delta (id and name) stays on its own, as OpenAI sends it."""
    out: list[StreamEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallDelta)
            and event.id is None
            and isinstance(last, ToolCallDelta)
            and last.id is None
            and last.index == event.index
        ):
            out[-1] = ToolCallDelta(last.index, None, None, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


def collect(events: list[StreamEvent]) -> ParsedMessage:
    """The message a complete list of events describes."""
    content: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif event.id is not None:
            calls[event.index] = (event.id, event.name or "", [event.arguments])
        else:
            calls[event.index][2].append(event.arguments)
    tool_calls = [
        ToolCall(id=call_id, name=name, arguments="".join(fragments))
        for _, (call_id, name, fragments) in sorted(calls.items())
    ]
    return ParsedMessage(content="".join(content), tool_calls=tool_calls)
