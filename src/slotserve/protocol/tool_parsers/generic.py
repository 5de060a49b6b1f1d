"""Tool calls for chat templates that know nothing of tools (our SmolLM2 is plain ChatML).

The server describes the tools in a system message (``generic_prompt.py``) and the model's
whole output is one JSON object::

    {"tool_calls": [{"name": "f", "arguments": {...}}, ...]}   calls
    {"tool_call": {"name": "f", "arguments": {...}}}           one call
    {"response": "text"}                                       an answer; content is the string

Streaming: the ``response`` string is decoded and sent as content while it arrives; a response
cut off by the token limit keeps what was decoded. Output that does not start with ``{`` is
plain content, passed on at once. Anything else (other keys, bad JSON, text after the object)
makes the whole output content.
"""

from __future__ import annotations

import json

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.grammar import call_schema, json_rule
from slotserve.protocol.tool_parsers.json_scan import JsonStringDecoder
from slotserve.protocol.tool_parsers.section_stream import SectionParser, SectionStream, State


class GenericStream(SectionStream):
    whole_output_opener = "{"

    def __init__(self, whole: bool = False) -> None:
        super().__init__(whole)
        self._key_start = 0
        self._key = ""
        self._escape = False
        self._decoder = JsonStringDecoder()
        self._list_done = self._to_object_end

    def _after_opener(self) -> State:
        return self._key_open

    def _key_open(self, c: str) -> bool:
        if c.isspace():
            return True
        if c != '"':
            return self._fail()
        self._key_start = self._pos
        self._state = self._key_text
        return True

    def _key_text(self, c: str) -> bool:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            try:
                self._key = json.loads(self._text[self._key_start : self._pos + 1])
            except ValueError:
                return self._fail()
            self._state = self._colon
        return True

    def _colon(self, c: str) -> bool:
        return self._expect(c, ":", self._value)

    def _value(self, c: str) -> bool:
        if c.isspace():
            return True
        if self._key == "tool_calls" and c == "[":
            self._state = self._list_item_or_end
            return True
        if self._key == "tool_call" and c == "{":
            return self._begin_call(self._to_object_end)
        if self._key == "response" and c == '"':
            self._state = self._response
            return True
        return self._fail()

    def _response(self, c: str) -> bool:
        try:
            text, ended = self._decoder.push(c)
        except ValueError:
            return self._fail()
        self._out.content(text)
        if ended:
            self._state = self._object_end
        return True

    def _to_object_end(self) -> None:
        self._state = self._object_end

    def _object_end(self, c: str) -> bool:
        return self._expect(c, "}", self._trailing)

    def _complete_at_end(self) -> bool:
        # A response or call list cut off after its value still says what it meant.
        return self._state in (self._response, self._object_end, self._trailing)


class GenericParser(SectionParser):
    name = "generic"
    stream_class = GenericStream

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        """The ``tool_calls`` form (one call unless ``parallel``); with ``required=False``,
        the ``response`` form as well."""
        if not tools:
            raise ValueError("A tool-call grammar needs at least one tool.")
        calls: dict[str, object] = {"type": "array", "items": call_schema(tools), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        calls_form = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        response_form = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        schema = calls_form if required else {"anyOf": [calls_form, response_form]}
        return f"start: {json_rule(schema)}\n"
