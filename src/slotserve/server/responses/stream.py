"""The pipeline's events (``server/events.py``) → the Responses API's typed stream events.

Each output item (reasoning, the text message, each tool call) is opened when its first
delta arrives and closed when another kind starts or the choice finishes, so the events of one
item never interleave with another's: the order OpenAI's own streams have.

A call to a custom tool arrives as the JSON wrapper the model writes (``tools.py``); its input
is unwrapped when the call is whole, so it goes out as one ``custom_tool_call_input.delta``
before its ``done``: cutting a JSON string's escapes apart mid-stream would need a partial
JSON decoder for no gain a client can see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotserve.server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArguments,
    ToolCallStart,
    Usage,
)
from slotserve.server.responses.output import (
    OutputOptions,
    call_item,
    failed,
    finished,
    message_item,
    new_id,
    reasoning_item,
)
from slotserve.server.sse import sse


@dataclass
class _Item:
    kind: str  # "message", "reasoning" or "call"
    item_id: str
    output_index: int
    options: OutputOptions
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    call_index: int | None = None  # the call's index among the choice's calls

    def built(self, status: str) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "message":
            scores = self.logprobs if self.options.logprobs else None
            return message_item(self.item_id, text, status, scores)
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, text, status, self.options.encrypted_reasoning)
        names = self.options.names
        return call_item(names, self.item_id, self.call_id, self.name, text, status)

    @property
    def custom(self) -> bool:
        return self.kind == "call" and self.options.names.ref(self.name).kind == "custom"


class ResponseEventStream:
    """Feeds on one choice's events; every method returns the SSE frames to send next."""

    def __init__(self, shell: dict[str, Any], options: OutputOptions | None = None) -> None:
        self.shell = shell
        self.options = options or OutputOptions()
        # Scores of tokens whose text has not come out yet (a parser may hold text back).
        self._scores: list[dict[str, Any]] = []
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None  # the final one, once completed
        self._sequence = 0
        self._open: _Item | None = None
        self._finish_reason: str | None = None
        self._usage: Usage | None = None

    def _event(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(payload, event=type_)

    def opening(self) -> list[str]:
        return [
            self._event("response.created", response=self.shell),
            self._event("response.in_progress", response=self.shell),
        ]

    def feed(self, event: Event) -> list[str]:
        match event:
            case TokenLogprobs() if self.options.logprobs is not None:
                self._scores += self.options.logprobs(event.tokens)
            case ReasoningDelta() if event.text:
                return self._text("reasoning", event.text)
            case TextDelta() if event.text:
                return self._text("message", event.text)
            case ToolCallStart():
                return self._start_call(event.index, event.call_id, event.name)
            case ToolCallArguments() if event.arguments:
                return self._arguments(event.index, event.arguments)
            case ChoiceFinished() if event.reason:
                self._finish_reason = event.reason
                return self._close()
            case Usage():
                self._usage = event
        return []

    def complete(self) -> list[str]:
        frames = self._close()
        if not self.output:  # an empty answer is still a message, as in the JSON answer
            frames += self._start(self._item("message", new_id("msg"), 0)) + self._close()
        self.response = finished(self.shell, self.output, self._usage, self._finish_reason)
        status = self.response["status"]
        return [*frames, self._event(f"response.{status}", response=self.response)]

    def fail(self, error: Any) -> list[str]:
        output = list(self.output)
        if self._open is not None:
            output.append(self._open.built("incomplete"))
        return [self._event("response.failed", response=failed(self.shell, output, error))]

    def _text(self, kind: str, text: str) -> list[str]:
        frames = []
        item = self._open
        if item is None or item.kind != kind:
            frames += self._close()  # first: it takes the output index before the new item
            item = self._item(kind, new_id("msg" if kind == "message" else "rs"), len(self.output))
            frames += self._start(item)
        item.parts.append(text)
        name = "output_text" if kind == "message" else "reasoning_text"
        extra: dict[str, Any] = {}
        if kind == "message":
            scores, self._scores = self._scores, []
            item.logprobs += scores
            extra["logprobs"] = scores
        frames.append(
            self._event(
                f"response.{name}.delta",
                item_id=item.item_id,
                output_index=item.output_index,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return frames

    def _start_call(self, index: int, call_id: str, name: str) -> list[str]:
        frames = self._close()  # first: it takes the output index before the new item
        item = self._item("call", new_id("fc"), len(self.output), call_index=index)
        item.call_id, item.name = call_id, name
        return frames + self._start(item)

    def _arguments(self, index: int, arguments: str) -> list[str]:
        frames = []
        item = self._open
        if item is None or item.kind != "call" or item.call_index != index:
            # A fragment for no open call starts one rather than being lost.
            frames += self._start_call(index, new_id("call"), "")
            item = self._open
            assert item is not None
        item.parts.append(arguments)
        if item.custom:
            return frames
        frames.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=item.item_id,
                output_index=item.output_index,
                delta=arguments,
            )
        )
        return frames

    def _item(self, kind: str, item_id: str, index: int, call_index: int | None = None) -> _Item:
        return _Item(kind, item_id, index, self.options, call_index=call_index)

    def _start(self, item: _Item) -> list[str]:
        self._open = item
        added = item.built("in_progress")
        if item.kind == "call":
            return [self._added(item, added)]
        part = added["content"][0]
        added["content"] = []  # a text item is announced with no parts, then its part
        place = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        return [
            self._added(item, added),
            self._event("response.content_part.added", **place, part=part),
        ]

    def _added(self, item: _Item, built: dict[str, Any]) -> str:
        return self._event("response.output_item.added", output_index=item.output_index, item=built)

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        # Only the item the output ended in was cut short by the length limit.
        cut = self._finish_reason == "length"
        done = item.built("incomplete" if cut else "completed")
        self.output.append(done)
        place = {"item_id": item.item_id, "output_index": item.output_index}
        text = "".join(item.parts)
        if item.custom:
            text = done["input"]
            frames = [
                self._event("response.custom_tool_call_input.delta", **place, delta=text),
                self._event("response.custom_tool_call_input.done", **place, input=text),
            ]
        elif item.kind == "call":
            frames = [self._event("response.function_call_arguments.done", **place, arguments=text)]
        else:
            name = "output_text" if item.kind == "message" else "reasoning_text"
            extra: dict[str, Any] = {}
            if item.kind == "message":
                extra["logprobs"] = item.logprobs
            frames = [
                self._event(f"response.{name}.done", **place, content_index=0, text=text, **extra),
                self._event(
                    "response.content_part.done", **place, content_index=0, part=done["content"][0]
                ),
            ]
        frames.append(
            self._event("response.output_item.done", output_index=item.output_index, item=done)
        )
        return frames
