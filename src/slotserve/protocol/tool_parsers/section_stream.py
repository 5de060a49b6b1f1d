"""The machinery the format parsers share: a character-at-a-time state machine over the output.

Every format is one ``SectionStream`` subclass, and ``parse`` is that same machine fed the whole
text at once (``whole=True``), so a parse and a stream cannot disagree on a call that
completes. The text is kept whole and states work on offsets into it::

    text:  ...content released | held back | section (undecided)  | not yet read
                               ^_emitted   ^_section_start         ^_pos

A state handles the character at ``_pos`` and returns True to move on, or False to have the
state it switched to see the same character (how a failed section hands over the character
that broke it). Whitespace next to a call is not content: held back before a marker, dropped
after a committed section unless more content follows.
"""

from __future__ import annotations

from collections.abc import Callable

from slotserve.protocol.tool_parsers.base import ParsedMessage, StreamEvent, ToolCallStream
from slotserve.protocol.tool_parsers.events import EventSink, collect
from slotserve.protocol.tool_parsers.json_call import CallStatus, JsonCallReader

State = Callable[[str], bool]


class SectionStream:
    markers: tuple[str, ...] = ()
    # Set by formats whose calls are the whole output: the character that opens them.
    whole_output_opener: str | None = None
    # A list of calls: items between separators, up to its close; a list without one (Llama
    # 3's) runs to the end of the output.
    list_separator = ","
    list_close: str | None = "]"

    def __init__(self, whole: bool = False) -> None:
        self._text = ""
        self._pos = 0
        self._out = EventSink(whole)
        self._emitted = 0
        self._section_start = 0
        self._since_call = False
        self._marker_chars = frozenset("".join(self.markers))
        self._call: JsonCallReader | None = None
        self._call_done: Callable[[], None] = self._no_op
        self._list_done: Callable[[], None] = self._no_op
        self._state: State = self._initial_state()

    @classmethod
    def parse(cls, text: str) -> ParsedMessage:
        stream = cls(whole=True)
        return collect(stream.feed(text) + stream.finish())

    def feed(self, text: str) -> list[StreamEvent]:
        self._text += text
        while self._pos < len(self._text):
            if self._state(self._text[self._pos]):
                self._pos += 1
        return self._out.take()

    def finish(self) -> list[StreamEvent]:
        self._end()
        return self._out.take(final=True)

    # --- what a format defines -------------------------------------------------------------

    def _initial_state(self) -> State:
        return self._plain if self.whole_output_opener is None else self._whole_output_start

    def _after_opener(self) -> State:
        """Where a whole-output format reads on after its opener."""
        raise NotImplementedError

    def _after_marker(self, marker: str) -> None:
        raise NotImplementedError

    def _after_failure(self) -> State:
        return self._tail

    def _complete_at_end(self) -> bool:
        """Whether the section open when the output ends holds complete calls."""
        return False

    def _end(self) -> None:
        """Decides what is held or open when the output ends: plain text is released (or
        dropped, when it is whitespace after a call), a failed stretch is content, and an open
        section commits only where the format says it is complete."""
        if self._state in (self._initial_state(), self._plain):
            self._end_plain()
        elif self._state == self._after_failure():
            self._release(len(self._text))
        else:
            self._end_section(committed=self._complete_at_end())

    # --- content ---------------------------------------------------------------------------

    def _release(self, upto: int) -> None:
        if upto > self._emitted:
            self._out.content(self._text[self._emitted : upto])
            self._since_call = False
            self._emitted = upto

    def _plain(self, c: str) -> bool:
        """Content, watching for a marker that opens a section."""
        end = self._pos + 1
        if not (c.isspace() or c in self._marker_chars):
            self._release(end)
            return True
        for marker in self.markers:
            if self._text.endswith(marker, self._emitted, end):
                start = self._blank_start(end - len(marker))
                self._release(start)
                self._open_section(start)
                self._after_marker(marker)
                return True
        self._release(self._hold_from(end))
        return True

    def _hold_from(self, end: int) -> int:
        """Where the text that may yet become part of a call begins: a marker's beginning
        (the earliest suffix that is a prefix of one) and the whitespace before it."""
        keep = end
        for marker in self.markers:
            for k in range(min(len(marker) - 1, end - self._emitted), 0, -1):
                if self._text.startswith(marker[:k], end - k):
                    keep = min(keep, end - k)
                    break
        return self._blank_start(keep)

    def _blank_start(self, end: int) -> int:
        while end > self._emitted and self._text[end - 1].isspace():
            end -= 1
        return end

    def _end_plain(self) -> None:
        held = self._text[self._emitted :]
        if self._since_call and held.isspace():
            self._emitted = len(self._text)
        else:
            self._release(len(self._text))

    def _tail(self, c: str) -> bool:
        """Everything from here on is content."""
        self._release(len(self._text))
        self._pos = len(self._text) - 1
        return True

    # --- sections --------------------------------------------------------------------------

    def _open_section(self, start: int) -> None:
        self._section_start = start
        self._out.open_section()

    def _whole_output_start(self, c: str) -> bool:
        """Past leading whitespace, the opener opens the section and ``_after_opener`` reads
        on; any other character makes the whole output content."""
        if c.isspace():
            return True
        if c == self.whole_output_opener:
            self._open_section(self._emitted)
            self._state = self._after_opener()
            return True
        self._state = self._tail
        return False

    def _expect(self, c: str, expected: str, then: State) -> bool:
        """Past whitespace, ``expected`` leads to ``then``; anything else fails the section."""
        if c.isspace():
            return True
        if c != expected:
            return self._fail()
        self._state = then
        return True

    def _trailing(self, c: str) -> bool:
        """After the calls of a whole-output format: only whitespace may follow."""
        return True if c.isspace() else self._fail()

    def _commit(self, end: int) -> None:
        self._out.commit()
        self._emitted = end
        self._since_call = True

    def _fail(self) -> bool:
        """The open section is no call: its text so far becomes content, and the character
        that broke it goes to the format's fallback state."""
        self._out.fail(self._text[self._section_start : self._pos])
        self._emitted = self._pos
        self._since_call = False
        self._state = self._after_failure()
        return False

    def _fail_at_end(self) -> None:
        self._out.fail(self._text[self._section_start :])
        self._emitted = len(self._text)

    def _end_section(self, committed: bool) -> None:
        if committed:
            self._commit(len(self._text))
        else:
            self._fail_at_end()

    # --- JSON calls and lists of them --------------------------------------------------------

    def _begin_call(self, then: Callable[[], None]) -> bool:
        """Called on the ``{`` that opens a call object; returns False so it is read again."""
        self._call = JsonCallReader(self._out)
        self._call_done = then
        self._state = self._in_call
        return False

    def _call_or_fail(self, c: str, then: Callable[[], None]) -> bool:
        """Past whitespace, a ``{`` opens a call object (``then`` runs once it closes); anything
        else fails the section."""
        if c.isspace():
            return True
        if c == "{":
            return self._begin_call(then)
        return self._fail()

    def _in_call(self, c: str) -> bool:
        assert self._call is not None
        status = self._call.push(c)
        if status is CallStatus.FAILED:
            return self._fail()
        if status is CallStatus.DONE:
            self._call_done()
        return True

    def _list_item_or_end(self, c: str) -> bool:
        """Inside ``[`` of a list of call objects, which may be empty."""
        if c == self.list_close:
            self._list_done()
            return True
        return self._list_item(c)

    def _list_item(self, c: str) -> bool:
        """A list's item: a call object, unless the format's items are other calls."""
        return self._call_or_fail(c, self._to_list_next)

    def _to_list_next(self) -> None:
        self._state = self._list_next

    def _list_next(self, c: str) -> bool:
        """After an item, past whitespace: the separator, or the list's close."""
        if c.isspace():
            return True
        if c == self.list_separator:
            self._state = self._list_item
        elif c == self.list_close:
            self._list_done()
        else:
            return self._fail()
        return True

    def _no_op(self) -> None:
        pass


class SectionParser:
    """A format's parser: ``parse`` and ``stream`` are its ``SectionStream`` (fed the whole
    text, or piece by piece); each format adds its ``name``, machine and ``grammar``."""

    name: str
    stream_class: type[SectionStream]

    def parse(self, text: str) -> ParsedMessage:
        return self.stream_class.parse(text)

    def stream(self) -> ToolCallStream:
        return self.stream_class()
