"""The types every tool-call parser shares: the tools a request offers, what a parser finds in
the model's text (all at once or piece by piece), and the parser interface itself."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# What a tool without parameters means: an object with nothing in it.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    """One entry of the request's ``tools`` (type ``"function"``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.parameters:
            # NOTE: a frozen dataclass can only be normalised this way; the default makes a
            # schema-less tool look like any other to the grammars and the prompt.
            object.__setattr__(self, "parameters", dict(EMPTY_PARAMETERS))

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> FunctionTool:
        """From ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        function = tool["function"]
        return cls(
            name=function["name"],
            description=function.get("description"),
            parameters=dict(function.get("parameters") or {}),
        )


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # The arguments object as JSON text, exactly what the streamed fragments concatenate to.
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None  # the first delta of a call only
    name: str | None  # the first delta of a call only
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


class ToolCallStream(Protocol):
    def feed(self, text: str) -> list[StreamEvent]:
        """Takes the next decoded piece of model output; returns what can be told so far."""
        ...

    def finish(self) -> list[StreamEvent]:
        """End of output: everything held back comes out (as content if it made no call)."""
        ...


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedMessage: ...

    def stream(self) -> ToolCallStream: ...

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        """An llguidance Lark grammar for constrained decoding of calls to ``tools``."""
        ...


def make_call_id() -> str:
    """An id of the shape OpenAI gives tool calls."""
    return "call_" + secrets.token_hex(12)
