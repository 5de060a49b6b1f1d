"""Tool-call parsers: the model's text → content and OpenAI tool calls, whole or streamed, and
the grammar that makes a model write a call (``tool_choice: "required"`` or a named function).

One module per output format; ``parser_for_template`` picks one from the chat template.
"""

from __future__ import annotations

from collections.abc import Callable

from slotserve.protocol.tool_parsers.base import (
    ContentDelta,
    FunctionTool,
    ParsedMessage,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    make_call_id,
)
from slotserve.protocol.tool_parsers.generic import GenericParser
from slotserve.protocol.tool_parsers.generic_prompt import generic_system_prompt
from slotserve.protocol.tool_parsers.hermes import HermesParser
from slotserve.protocol.tool_parsers.llama3_json import Llama3JsonParser
from slotserve.protocol.tool_parsers.mistral import MistralParser
from slotserve.protocol.tool_parsers.pythonic import PythonicParser

_FACTORIES: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "generic": GenericParser,
}
TOOL_PARSERS: tuple[str, ...] = tuple(_FACTORIES)


def get_tool_parser(name: str) -> ToolParser:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"Unknown tool-call parser {name!r}; choose one of: {', '.join(TOOL_PARSERS)}."
        )
    return factory()


def parser_for_template(template_source: str | None) -> ToolParser:
    """The parser for the format a chat template teaches; ``generic`` when it teaches none."""
    source = template_source or ""
    if "<tool_call>" in source:
        return HermesParser()
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    # Llama 3.2's pythonic template shows the list it wants: "[func_name1(params_name1=...".
    if "[func_name1(" in source:
        return PythonicParser()
    if "<|python_tag|>" in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return Llama3JsonParser()
    return GenericParser()


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "FunctionTool",
    "ParsedMessage",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "generic_system_prompt",
    "get_tool_parser",
    "make_call_id",
    "parser_for_template",
]
