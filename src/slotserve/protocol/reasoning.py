"""Reasoning parsers: the model's ``<think>…</think>`` text → ``reasoning_content``.

``qwen3``: reasoning only when the output opens with ``<think>`` (after whitespace); it runs
to ``</think>``, or to the end when the output was cut off inside it. Without the opening tag
thinking was off and the whole output is content, tags and all.

``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output is reasoning up
to ``</think>`` whether or not it repeats the opening tag; with no ``</think>`` it is all
reasoning.

The tags go, with the whitespace before ``<think>`` and the newlines right around both tags.
``parse`` is the stream fed the whole text, so the two cannot disagree. Empty reasoning is
reported as None.
"""

from __future__ import annotations

from typing import Literal, Protocol

OPEN = "<think>"
CLOSE = "</think>"

Kind = Literal["reasoning", "content"]


class ReasoningStream(Protocol):
    def feed(self, text: str) -> list[tuple[Kind, str]]: ...

    def finish(self) -> list[tuple[Kind, str]]: ...


class ReasoningParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, str]: ...

    def stream(self) -> ReasoningStream: ...


class _ThinkStream:
    """States: ``start`` (waiting to see whether ``<think>`` opens the output), ``reasoning``,
    ``content``; newlines after a tag are dropped on the way in."""

    def __init__(self, implicit_open: bool) -> None:
        self._implicit_open = implicit_open
        self._buffer = ""
        self._state = "start"
        self._drop_newlines = False

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[tuple[Kind, str]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        while True:
            if self._drop_newlines:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer and not final:
                    break
                self._drop_newlines = False
            state = self._state
            if state == "start":
                self._start(final)
            elif state == "reasoning":
                self._reasoning(out, final)
            else:
                _emit(out, "content", self._buffer)
                self._buffer = ""
            if self._state == state:
                break
        return out

    def _start(self, final: bool) -> None:
        head = self._buffer.lstrip()
        if head.startswith(OPEN):
            self._buffer = head[len(OPEN) :]
            self._state, self._drop_newlines = "reasoning", True
        elif final or not OPEN.startswith(head):
            self._state = "reasoning" if self._implicit_open else "content"

    def _reasoning(self, out: list[tuple[Kind, str]], final: bool) -> None:
        end = self._buffer.find(CLOSE)
        if end >= 0:
            _emit(out, "reasoning", self._buffer[:end].rstrip("\n"))
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._state, self._drop_newlines = "content", True
            return
        keep = 0 if final else _held_back(self._buffer)
        _emit(out, "reasoning", self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]


def _held_back(text: str) -> int:
    """How much of the end of ``text`` may still belong to ``</think>`` and the newlines
    before it."""
    keep = next(
        (k for k in range(min(len(CLOSE) - 1, len(text)), 0, -1) if text.endswith(CLOSE[:k])), 0
    )
    while keep < len(text) and text[len(text) - keep - 1] == "\n":
        keep += 1
    return keep


def _emit(out: list[tuple[Kind, str]], kind: Kind, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


class _ThinkParser:
    def __init__(self, name: str, implicit_open: bool) -> None:
        self.name = name
        self._implicit_open = implicit_open

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self._implicit_open)

    def parse(self, text: str) -> tuple[str | None, str]:
        stream = _ThinkStream(self._implicit_open)
        events = stream.feed(text) + stream.finish()
        reasoning = "".join(piece for kind, piece in events if kind == "reasoning")
        content = "".join(piece for kind, piece in events if kind == "content")
        return reasoning or None, content


_IMPLICIT_OPEN = {"qwen3": False, "deepseek_r1": True}
REASONING_PARSERS: tuple[str, ...] = tuple(_IMPLICIT_OPEN)


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in _IMPLICIT_OPEN:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose one of: {', '.join(REASONING_PARSERS)}."
        )
    return _ThinkParser(name, _IMPLICIT_OPEN[name])
