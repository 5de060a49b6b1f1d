"""Mistral calls: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, text before kept.

A single object after the marker (no list) is taken as one call too. The list is one unit: if
any part of it is not a call, everything from the marker to the end is content.
"""

from __future__ import annotations

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.grammar import call_schema, check_tools, json_rule, repeat
from slotserve.protocol.tool_parsers.section_stream import SectionParser, SectionStream

MARKER = "[TOOL_CALLS]"


class MistralStream(SectionStream):
    markers = (MARKER,)

    def __init__(self, whole: bool = False) -> None:
        super().__init__(whole)
        self._list_done = self._section_done

    def _after_marker(self, marker: str) -> None:
        self._state = self._calls_open

    def _calls_open(self, c: str) -> bool:
        if c.isspace():
            return True
        if c == "[":
            self._state = self._list_item_or_end
            return True
        if c == "{":
            return self._begin_call(self._section_done)
        return self._fail()

    def _section_done(self) -> None:
        self._commit(self._pos + 1)
        self._state = self._plain


class MistralParser(SectionParser):
    name = "mistral"
    stream_class = MistralStream

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        check_tools(tools, required)
        return (
            f'start: "{MARKER}[" {repeat("call", ", ", parallel)} "]"\n'
            f"call: {json_rule(call_schema(tools))}\n"
        )
