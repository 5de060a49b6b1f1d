"""The Lark grammar of a pythonic call list: ``[get_weather(city="Paris"), f2()]``.

Names are the tools', keywords the parameters' own, and a parameter whose schema has a plain
``type`` gets a literal of that kind; the rest of a schema (enums, nested properties,
``required``) is not checked here.
"""

from __future__ import annotations

from typing import Any

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.grammar import check_tools, literal, repeat

_LITERALS = r"""
value: STRING | NUMBER | bool | "None" | list | dict
bool: "True" | "False"
list: "[" (value (", " value)*)? "]"
dict: "{" (STRING ": " value (", " STRING ": " value)*)? "}"
STRING: /"([^"\\\n]|\\.)*"/ | /'([^'\\\n]|\\.)*'/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
INT: /-?(0|[1-9][0-9]*)/
"""

_BY_TYPE = {
    "string": "STRING",
    "integer": "INT",
    "number": "NUMBER",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": '"None"',
}


def pythonic_grammar(tools: list[FunctionTool], required: bool, parallel: bool) -> str:
    check_tools(tools, required)
    rules = [
        f'start: "[" {repeat("call", ", ", parallel)} "]"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        if not tool.name.isidentifier():
            raise ValueError(f"The tool name {tool.name!r} cannot be written as a Python call.")
        arguments = _argument_alternatives(tool.parameters)
        if arguments:
            rules.append(f'call_{i}: {literal(tool.name + "(")} (arg_{i} (", " arg_{i})*)? ")"')
            rules.append(f"arg_{i}: " + " | ".join(arguments))
        else:
            rules.append(f"call_{i}: {literal(tool.name + '()')}")
    return "\n".join(rules) + "\n" + _LITERALS


def _argument_alternatives(parameters: dict[str, Any]) -> list[str]:
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return []
    return [
        f"{literal(name + '=')} {_value_rule(schema)}"
        for name, schema in properties.items()
        if isinstance(name, str) and name.isidentifier()
    ]


def _value_rule(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    rules = [_BY_TYPE[k] for k in kinds if isinstance(k, str) and k in _BY_TYPE]
    if not rules or len(rules) != len(kinds):
        return "value"
    return rules[0] if len(rules) == 1 else "(" + " | ".join(rules) + ")"
