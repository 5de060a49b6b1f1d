"""Following JSON one character at a time, for parsers that must act before a value is whole.

``ObjectScanner`` knows where each top-level member of an object lies and when the object
ends; it checks only what it needs to notice early that text is not JSON (brackets, the
characters allowed outside strings, the key/colon/value/comma order at the top level). The
complete object is still checked by ``json.loads`` before anything trusts it.
``JsonStringDecoder`` turns the body of a JSON string into text as it arrives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_SCALAR_CHARS = frozenset("-+.0123456789eEtrufalsn")
_CLOSER = {"{": "}", "[": "]"}


@dataclass
class Member:
    key: str
    value_start: int | None = None
    value_end: int | None = None  # exclusive; None while the value is still open


class ObjectScanner:
    def __init__(self) -> None:
        self.chars: list[str] = []
        self.members: list[Member] = []
        self.done = False
        self.failed = False
        self._stack: list[str] = []
        self._expect = "open"
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._scalar = False

    def text(self, start: int = 0, end: int | None = None) -> str:
        return "".join(self.chars[start:end])

    def member(self, key: str) -> Member | None:
        return next((m for m in self.members if m.key == key), None)

    def push(self, c: str) -> None:
        if self.done or self.failed:
            self.failed = True
            return
        pos = len(self.chars)
        self.chars.append(c)
        if self._in_string:
            self._string_char(c, pos)
        elif len(self._stack) == 1 and self._expect != "nested":
            self._top_level_char(c, pos)
        else:
            self._nested_char(c, pos)

    def _string_char(self, c: str, pos: int) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            self._string_closed(pos)
        elif c < " ":
            self.failed = True  # json.loads refuses raw control characters in strings

    def _string_closed(self, pos: int) -> None:
        if self._expect == "key_string":
            try:
                key = json.loads(self.text(self._string_start, pos + 1))
            except ValueError:
                self.failed = True
                return
            self.members.append(Member(key))
            self._expect = "colon"
        elif self._expect == "value_string":
            self.members[-1].value_end = pos + 1
            self._expect = "comma_or_end"

    def _top_level_char(self, c: str, pos: int) -> None:
        if self._scalar:
            if c in _SCALAR_CHARS:
                return
            self._scalar = False
            self.members[-1].value_end = pos
            self._expect = "comma_or_end"
        if c.isspace():
            return
        expect = self._expect
        if expect in ("key_or_end", "key") and c == '"':
            self._in_string, self._string_start, self._expect = True, pos, "key_string"
        elif expect in ("key_or_end", "comma_or_end") and c == "}":
            self._stack.pop()
            self.done = True
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "comma_or_end" and c == ",":
            self._expect = "key"
        elif expect == "value":
            self._value_start(c, pos)
        else:
            self.failed = True

    def _value_start(self, c: str, pos: int) -> None:
        self.members[-1].value_start = pos
        if c == '"':
            self._in_string, self._expect = True, "value_string"
        elif c in _CLOSER:
            self._stack.append(c)
            self._expect = "nested"
        elif c in _SCALAR_CHARS:
            self._scalar = True
        else:
            self.failed = True

    def _nested_char(self, c: str, pos: int) -> None:
        if not self._stack:
            if c == "{" and self._expect == "open":
                self._stack.append(c)
                self._expect = "key_or_end"
            else:
                self.failed = True
        elif c in _CLOSER:
            self._stack.append(c)
        elif c in "}]":
            if _CLOSER[self._stack.pop()] != c:
                self.failed = True
            elif len(self._stack) == 1:
                self.members[-1].value_end = pos + 1
                self._expect = "comma_or_end"
        elif c == '"':
            self._in_string = True
        elif not (c.isspace() or c in ",:" or c in _SCALAR_CHARS):
            self.failed = True


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonStringDecoder:
    """Fed the characters after a string's opening quote; ``push`` returns the text decoded so
    far and whether the closing quote came. Raises ``ValueError`` on a bad escape."""

    def __init__(self) -> None:
        self._escape = False
        self._hex: str | None = None
        self._high: int | None = None  # a high surrogate waiting for its low half

    def push(self, c: str) -> tuple[str, bool]:
        if self._hex is not None:
            self._hex += c
            if len(self._hex) < 4:
                return "", False
            if not all(h in _HEX_DIGITS for h in self._hex):
                raise ValueError(f"bad escape \\u{self._hex}")
            code = int(self._hex, 16)
            self._hex = None
            return self._code_point(code), False
        if self._escape:
            self._escape = False
            if c == "u":
                self._hex = ""
                return "", False
            if c not in _ESCAPES:
                raise ValueError(f"bad escape \\{c}")
            return self._flush_high() + _ESCAPES[c], False
        if c == "\\":
            self._escape = True
            return "", False
        if c == '"':
            return self._flush_high(), True
        return self._flush_high() + c, False

    def _code_point(self, code: int) -> str:
        if 0xD800 <= code < 0xDC00:
            previous = self._flush_high()
            self._high = code
            return previous
        if 0xDC00 <= code < 0xE000 and self._high is not None:
            high, self._high = self._high, None
            return chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00))
        return self._flush_high() + _text_of(code)

    def _flush_high(self) -> str:
        if self._high is None:
            return ""
        self._high = None
        return "\ufffd"  # a lone surrogate cannot be sent as UTF-8


def _text_of(code: int) -> str:
    return "\ufffd" if 0xD800 <= code < 0xE000 else chr(code)
