"""Llama 3.2 / Llama 4 pythonic calls: ``[get_weather(city="Paris"), f2()]``.

The whole output is the list. Each call is read with ``ast`` once its closing parenthesis
arrives; only keyword arguments with literal values count (strings, numbers, booleans,
``None``, lists, tuples, dicts with string keys), turned into a JSON object by ``json.dumps``.
So a call's first delta goes out at its ``(``, and its arguments in one fragment at its ``)``.
Anything else (positional arguments, expressions, text after the ``]``) makes the whole
output content. Triple-quoted strings holding quotes of their own are not followed.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from slotserve.protocol.tool_parsers.base import FunctionTool
from slotserve.protocol.tool_parsers.pythonic_grammar import pythonic_grammar
from slotserve.protocol.tool_parsers.section_stream import SectionParser, SectionStream, State


class PythonicStream(SectionStream):
    whole_output_opener = "["

    def __init__(self, whole: bool = False) -> None:
        super().__init__(whole)
        self._name_start = 0
        self._args_start = 0
        self._index = 0
        self._depth = 0
        self._quote: str | None = None
        self._escape = False
        self._list_done = self._to_trailing

    def _after_opener(self) -> State:
        return self._list_item

    def _list_item(self, c: str) -> bool:
        """A call's name begins the item (not a JSON object)."""
        if c.isspace():
            return True
        if not c.isidentifier():
            return self._fail()
        self._name_start = self._pos
        self._state = self._name
        return True

    def _name(self, c: str) -> bool:
        if c.isalnum() or c == "_":
            return True
        if c != "(":
            return self._fail()
        self._index = self._out.start_call(self._text[self._name_start : self._pos])
        self._args_start = self._pos + 1
        self._depth = 0
        self._state = self._arguments
        return True

    def _arguments(self, c: str) -> bool:
        """Finds the call's closing parenthesis, skipping strings and nested brackets."""
        if self._quote is not None:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == self._quote:
                self._quote = None
        elif c in "'\"":
            self._quote = c
        elif c in "([{":
            self._depth += 1
        elif c in ")]}" and self._depth > 0:
            self._depth -= 1
        elif c == ")":
            arguments = call_arguments(self._text[self._name_start : self._pos + 1])
            if arguments is None:
                return self._fail()
            self._out.arguments(self._index, arguments)
            self._state = self._list_next
        elif c in "]}":
            return self._fail()
        return True

    def _to_trailing(self) -> None:
        self._state = self._trailing

    def _complete_at_end(self) -> bool:
        return self._state == self._trailing


def call_arguments(source: str) -> str | None:
    """The keyword arguments of the call ``source`` as JSON object text, or None."""
    try:
        node = ast.parse(source, mode="eval").body
    # ``ast`` reports bad source as SyntaxError or ValueError, and very deep nesting as
    # RecursionError or MemoryError; none of them may escape a parse of model text.
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    names = [keyword.arg for keyword in node.keywords]
    if None in names or len(set(names)) != len(names):
        return None
    try:
        values = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
        return json.dumps(values, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, str | bool | int):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        result = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise ValueError("dict keys must be strings")
            result[key.value] = _literal(item)
        return result
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


class PythonicParser(SectionParser):
    name = "pythonic"
    stream_class = PythonicStream

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        return pythonic_grammar(tools, required, parallel)
