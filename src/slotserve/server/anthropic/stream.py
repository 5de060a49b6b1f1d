"""The pipeline's events (``server/events.py``) → the Messages API's server-sent events.

``message_start`` (no content; the prompt's tokens as input), a ``ping``, then one content
block at a time: ``content_block_start``, its deltas (``thinking_delta`` and a closing
``signature_delta``, ``text_delta``, ``input_json_delta``), ``content_block_stop``; a block
is opened by its first delta and closed when another starts or the choice finishes, so blocks
never interleave. Then ``message_delta`` (stop reason, final usage) and ``message_stop``.
A failure mid-way is an ``error`` event and ends the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.server.anthropic.output import (
    SIGNATURE,
    anthropic_usage,
    message_shell,
    stop_reason_of,
    tool_use_id,
)
from slotserve.server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from slotserve.server.sse import sse


def frame(type_: str, **fields: Any) -> str:
    return sse({"type": type_, **fields}, event=type_)


@dataclass
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    index: int  # the block's position in the message's content
    call_index: int | None = None  # a tool use's index among the choice's calls


class MessageEventStream:
    """Feeds on one choice's events; every method returns the SSE frames to send next."""

    def __init__(
        self,
        message_id: str,
        model: str,
        num_prompt_tokens: int,
        stop_sequences: list[str] | None,
        show_thinking: bool,
    ) -> None:
        self._message_id = message_id
        self._model = model
        self._num_prompt_tokens = num_prompt_tokens
        self._stop_sequences = stop_sequences
        self._show_thinking = show_thinking
        self._open: _Block | None = None
        self._next_index = 0
        self.finish: ChoiceFinished | None = None
        self._usage: Usage | None = None

    def opening(self) -> list[str]:
        # What is read from the cache is known only at the end: message_delta's usage says.
        usage = anthropic_usage(Usage(self._num_prompt_tokens, 0, 0))
        shell = message_shell(self._message_id, self._model, usage)
        return [frame("message_start", message=shell), frame("ping")]

    def feed(self, event: Event) -> list[str]:
        match event:
            case ReasoningDelta() if event.text:
                frames = self._switch("thinking")
                if self._show_thinking:
                    frames.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
                return frames
            case TextDelta() if event.text:
                frames = self._switch("text")
                return [*frames, self._delta({"type": "text_delta", "text": event.text})]
            case ToolCallStart():
                return self._start_call(event.index, event.call_id, event.name)
            case ToolCallArguments() if event.arguments:
                frames = []
                if self._open is None or self._open.call_index != event.index:
                    # A fragment for no open call starts one rather than being lost.
                    frames += self._start_call(event.index, "", "")
                delta = {"type": "input_json_delta", "partial_json": event.arguments}
                return [*frames, self._delta(delta)]
            case ToolCallEnd():
                return self._close()
            case ChoiceFinished():
                self.finish = event
                return self._close()
            case Usage():
                self._usage = event
        return []

    def complete(self) -> list[str]:
        frames = self._close()
        reason, sequence = stop_reason_of(self.finish, self._stop_sequences)
        totals = self._usage or Usage(self._num_prompt_tokens, 0, 0)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        frames.append(frame("message_delta", delta=delta, usage=anthropic_usage(totals)))
        frames.append(frame("message_stop"))
        return frames

    def fail(self, error_type: str, message: str) -> list[str]:
        return [frame("error", error={"type": error_type, "message": message})]

    def _switch(self, kind: str) -> list[str]:
        if self._open is not None and self._open.kind == kind:
            return []
        frames = self._close()
        block: dict[str, Any] = {"type": kind, kind: ""}
        if kind == "thinking":
            block["signature"] = ""
        return frames + self._start(_Block(kind, self._next_index), block)

    def _start_call(self, index: int, call_id: str, name: str) -> list[str]:
        frames = self._close()
        call_id = tool_use_id(call_id or f"call_{self._message_id}_{index}")
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return frames + self._start(_Block("tool_use", self._next_index, index), block)

    def _start(self, block: _Block, shown: dict[str, Any]) -> list[str]:
        self._open = block
        self._next_index += 1
        return [frame("content_block_start", index=block.index, content_block=shown)]

    def _delta(self, delta: dict[str, Any]) -> str:
        assert self._open is not None
        return frame("content_block_delta", index=self._open.index, delta=delta)

    def _close(self) -> list[str]:
        block, frames = self._open, list[str]()
        if block is None:
            return frames
        if block.kind == "thinking":
            frames.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        self._open = None
        frames.append(frame("content_block_stop", index=block.index))
        return frames
