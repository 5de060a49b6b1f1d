"""Pieces of the llguidance Lark grammars the parsers return for constrained decoding.

A call's JSON goes in a ``%json`` rule whose schema fixes the name (one ``const`` per tool,
``anyOf`` over the tools) and gives the arguments the tool's own parameters schema, so the
engine can only sample a call the request allows. Markers are written as text: a tokenizer
that has them as special tokens still spells them with ordinary tokens under the grammar.
"""

from __future__ import annotations

import json
from typing import Any

from slotserve.engine.decoding.structured_output import closed_objects
from slotserve.protocol.tool_parsers.base import FunctionTool


def check_tools(tools: list[FunctionTool], required: bool) -> None:
    if not tools:
        raise ValueError("A tool-call grammar needs at least one tool.")
    if not required:
        raise ValueError(
            "This format has no grammar for an optional call; constrain only required calls."
        )


def call_schema(tools: list[FunctionTool], arguments_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call object ``{"name": ..., arguments_key: {...}}``."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                arguments_key: closed_objects(tool.parameters),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


# JSON spaced as ``json.dumps`` (and the templates' ``tojson``) writes it, the form models saw
# their calls rendered in; with free whitespace a small model can pad a call with newlines
# until the token limit.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": _JSON_STYLE, **schema}, ensure_ascii=False)


def literal(text: str) -> str:
    """A Lark string literal for ``text`` (JSON escaping is valid Lark escaping)."""
    return json.dumps(text, ensure_ascii=False)


def repeat(item: str, separator: str, parallel: bool) -> str:
    """One ``item``, or one or more separated by the literal ``separator``."""
    return f"{item} ({literal(separator)} {item})*" if parallel else item
