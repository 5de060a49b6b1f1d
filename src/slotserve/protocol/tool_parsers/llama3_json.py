"""Llama 3.1+ JSON calls: ``{"name": "f", "parameters": {...}}`` (``"arguments"`` also read),
several separated by ``;``, the output starting with the object or with ``<|python_tag|>``.

The calls run to the end of the output and are one unit: anything after them that is not
another call, or any call that does not parse, makes the whole stretch content. Text before
``<|python_tag|>`` is content; an output that starts with anything else is plain content.
"""

from __future__ import annotations

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.grammar import call_schema, check_tools, json_rule, repeat
from slotserve.protocol.tool_parsers.section_stream import SectionParser, SectionStream, State

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(SectionStream):
    markers = (PYTHON_TAG,)
    list_separator = ";"
    list_close = None

    def _initial_state(self) -> State:
        return self._start

    def _start(self, c: str) -> bool:
        """Only whitespace so far: a ``{`` now opens the calls."""
        if c.isspace():
            return True
        if c == "{":
            self._open_section(self._emitted)
            return self._begin_call(self._to_list_next)
        self._state = self._plain
        return False

    def _after_marker(self, marker: str) -> None:
        self._state = self._list_item

    def _complete_at_end(self) -> bool:
        return self._state == self._list_next


class Llama3JsonParser(SectionParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        """The calls as Llama writes them unprompted: ``parameters``, joined by ``"; "``."""
        check_tools(tools, required)
        return (
            f"start: {repeat('call', '; ', parallel)}\n"
            f"call: {json_rule(call_schema(tools, arguments_key='parameters'))}\n"
        )
