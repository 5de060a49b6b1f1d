"""A chat completion's two renderings of the pipeline's events (``pipeline.py``): the
``chat.completion`` object, and the ``chat.completion.chunk`` stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from slotserve.engine.runner_interface import Tokenizer
from slotserve.server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokenLogprobs,
    ToolCallArguments,
    ToolCallStart,
    Usage,
    fold,
)
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.openai.shapes import Envelope, chat_logprobs, usage, vllm_prompt_logprobs
from slotserve.server.pipeline import ChatGeneration


def chat_completion(
    generation: ChatGeneration,
    events: list[Event],
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    envelope: Envelope,
) -> dict[str, Any]:
    """The ``chat.completion`` object of a run that went to the end."""
    replies, totals = fold(events, generation.num_choices)
    assert totals is not None, "a finished run ends with its usage"
    choices = [
        {
            "index": i,
            "message": message(reply, shows_reasoning=generation.reasoning is not None),
            "logprobs": chat_logprobs(tokenizer, reply.logprobs) if body.logprobs else None,
            "finish_reason": reply.finish_reason,
        }
        for i, reply in enumerate(replies)
    ]
    response = {**envelope.fields(), "choices": choices, "usage": usage(totals)}
    if body.prompt_logprobs is not None:  # vLLM's extension: the rendered prompt's tokens
        response["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, replies[0].prompt_logprobs)
    return response


def message(reply: Reply, shows_reasoning: bool) -> dict[str, Any]:
    """The assistant message: ``reasoning_content`` whenever a reasoning parser runs, and
    ``content`` null beside tool calls when there is no text."""
    shown: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if shows_reasoning:
        shown["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        shown["content"] = reply.content or None
        shown["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in reply.tool_calls
        ]
    return shown


class ChatChunks:
    """The ``chat.completion.chunk`` frames: each choice opens with the assistant role, then
    one write per engine step and choice, where the step's logprobs ride on its first frame
    (on a frame with an empty delta while a parser holds the text back) and the finish
    reason on a frame of its own."""

    def __init__(self, envelope: Envelope, tokenizer: Tokenizer, num_choices: int) -> None:
        self._envelope = envelope
        self._tokenizer = tokenizer
        self._num_choices = num_choices

    def opening(self) -> list[str]:
        return [
            self._frame(i, {"role": "assistant", "content": ""}) for i in range(self._num_choices)
        ]

    def render(self, step: list[Event]) -> list[str]:
        first = step[0]
        if isinstance(first, Usage):
            return self._envelope.ending(first)
        deltas: list[dict[str, Any]] = []
        logprobs: dict[str, Any] | None = None
        finish: ChoiceFinished | None = None
        for event in step:
            match event:
                case TokenLogprobs():
                    logprobs = chat_logprobs(self._tokenizer, event.tokens)
                case TextDelta():
                    deltas.append({"content": event.text})
                case ReasoningDelta():
                    deltas.append({"reasoning_content": event.text})
                case ToolCallStart():
                    function = {"name": event.name, "arguments": ""}
                    call = {"index": event.index, "function": function}
                    deltas.append(
                        {"tool_calls": [{**call, "id": event.call_id, "type": "function"}]}
                    )
                case ToolCallArguments():
                    call = {"index": event.index, "function": {"arguments": event.arguments}}
                    deltas.append({"tool_calls": [call]})
                case ChoiceFinished():
                    finish = event
        if logprobs is not None and not deltas:
            deltas = [{}]  # the tokens' logprobs go out even while their text is held
        choice = first.choice
        frames = [
            self._frame(choice, delta, logprobs=logprobs if k == 0 else None)
            for k, delta in enumerate(deltas)
        ]
        if finish is not None:
            frames.append(self._frame(choice, {}, finish=finish.reason))
        return ["".join(frames)] if frames else []

    def _frame(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope.chunk(choice)


async def chat_chunks(generation: ChatGeneration, chunks: ChatChunks) -> AsyncGenerator[str, None]:
    for frame in chunks.opening():
        yield frame
    async with contextlib.aclosing(generation.stream()) as steps:
        async for step in steps:
            for write in chunks.render(step):
                yield write
