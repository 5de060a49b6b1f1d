"""Hermes, Qwen2.5 and Qwen3 calls, one block each::

    <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

Each block is decided on its own: a block that is not a call (bad JSON, no name, other text
before ``</tool_call>``) comes back as content, from its opening tag through its closing tag,
and the blocks around it still count. A last block with no closing tag (output cut at a
stop string or the token limit) is a call if its JSON object is complete.
"""

from __future__ import annotations

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.grammar import call_schema, check_tools, json_rule, repeat
from slotserve.protocol.tool_parsers.section_stream import SectionParser, SectionStream, State

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesStream(SectionStream):
    markers = (OPEN,)

    def __init__(self, whole: bool = False) -> None:
        super().__init__(whole)
        self._matched = 0  # characters of CLOSE read so far

    def _after_marker(self, marker: str) -> None:
        self._state = self._block_open

    def _after_failure(self) -> State:
        return self._invalid_block

    def _block_open(self, c: str) -> bool:
        return self._call_or_fail(c, self._to_block_close)

    def _to_block_close(self) -> None:
        self._matched = 0
        self._state = self._block_close

    def _block_close(self, c: str) -> bool:
        if self._matched == 0 and c.isspace():
            return True
        if c != CLOSE[self._matched]:
            return self._fail()
        self._matched += 1
        if self._matched == len(CLOSE):
            self._commit(self._pos + 1)
            self._state = self._plain
        return True

    def _invalid_block(self, c: str) -> bool:
        """Content through the end of a block that made no call."""
        end = self._pos + 1
        self._release(end)
        if self._text.endswith(CLOSE, 0, end):
            self._state = self._plain
        return True

    def _complete_at_end(self) -> bool:
        return self._state == self._block_close


class HermesParser(SectionParser):
    name = "hermes"
    stream_class = HermesStream

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        """``<tool_call>`` blocks, one per line, each holding one call to one of ``tools``."""
        check_tools(tools, required)
        return (
            f"start: {repeat('call', chr(10), parallel)}\n"
            f'call: "{OPEN}\\n" call_json "\\n{CLOSE}"\n'
            f"call_json: {json_rule(call_schema(tools))}\n"
        )
