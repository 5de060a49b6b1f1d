"""The chat pipeline's typed events without a server: the reply parser's event order (calls
opened, fed and ended; thinking split off), streamed and whole replies folding to the same
answer, and the chat chunk renderer's frames."""

from __future__ import annotations

import itertools
import json
from typing import Any

from slotserve.engine.outputs import SampledToken
from slotserve.protocol.reasoning import get_reasoning_parser
from slotserve.protocol.tool_parsers import get_tool_parser
from slotserve.server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    fold,
)
from slotserve.server.openai.chat_render import ChatChunks, message
from slotserve.server.openai.shapes import Envelope
from slotserve.server.reply_parser import ReplyParser, parse_reply
from tests.fake_runner import ByteTokenizer

HERMES_REPLY = (
    "<think>\nLooking it up.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def _streamed(text: str, size: int) -> list[Event]:
    parser = ReplyParser(0, get_tool_parser("hermes"), get_reasoning_parser("qwen3"))
    events: list[Event] = []
    for start in range(0, len(text), size):
        events += parser.feed(text[start : start + size])
    return events + parser.finish()


def _kinds(events: list[Event]) -> list[str]:
    # Runs of one kind of event count once: chunking decides how many pieces a run has.
    return [kind for kind, _ in itertools.groupby(type(e).__name__ for e in events)]


def test_streamed_calls_open_fill_and_end_in_order() -> None:
    for size in (1, 3, 7, len(HERMES_REPLY)):
        events = _streamed(HERMES_REPLY, size)
        assert _kinds(events) == [
            "ReasoningDelta",
            "TextDelta",
            "ToolCallStart",
            "ToolCallArguments",
            "ToolCallEnd",
            "ToolCallStart",
            "ToolCallArguments",
            "ToolCallEnd",
        ], size
        starts = [e for e in events if isinstance(e, ToolCallStart)]
        ends = [e for e in events if isinstance(e, ToolCallEnd)]
        assert [s.index for s in starts] == [e.index for e in ends] == [0, 1]
        assert all(s.call_id.startswith("call_") for s in starts)


def test_streamed_and_whole_replies_fold_to_the_same_answer() -> None:
    whole, has_calls = parse_reply(
        0, HERMES_REPLY, get_tool_parser("hermes"), get_reasoning_parser("qwen3")
    )
    assert has_calls
    (expected,), _ = fold(whole, 1)
    for size in (1, 5, len(HERMES_REPLY)):
        (streamed,), usage = fold(_streamed(HERMES_REPLY, size), 1)
        assert usage is None  # no Usage event: the run did not end
        assert streamed.reasoning == expected.reasoning == "Looking it up."
        assert streamed.content == expected.content
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
            (c.name, c.arguments) for c in expected.tool_calls
        ]
    shown = message(expected, shows_reasoning=True)
    assert list(shown) == ["role", "content", "reasoning_content", "tool_calls"]
    assert [call["function"]["name"] for call in shown["tool_calls"]] == ["get_weather", "get_time"]


def test_a_reply_without_parsers_is_all_text() -> None:
    events, has_calls = parse_reply(0, "<think>x</think>", None, None)
    assert events == [TextDelta(0, "<think>x</think>")] and not has_calls
    (reply,), _ = fold([*events, ChoiceFinished(0, "stop")], 1)
    assert message(reply, shows_reasoning=False) == {
        "role": "assistant",
        "content": "<think>x</think>",
    }
    assert reply.finish_reason == "stop"


def _frames(writes: list[str]) -> list[dict[str, Any]]:
    text = "".join(writes)
    return [
        json.loads(f.removeprefix("data: ")) for f in text.split("\n\n") if f and "[DONE]" not in f
    ]


def test_chat_chunks_carry_logprobs_on_the_first_frame_and_the_finish_alone() -> None:
    envelope = Envelope("chatcmpl-x", "chat.completion.chunk", 1, "m", include_usage=True)
    chunks = ChatChunks(envelope, ByteTokenizer(), num_choices=1)
    logprobs = TokenLogprobs(0, [SampledToken(104, -0.5)])
    held = chunks.render([logprobs])  # the parser holds the text back: an empty delta
    (frame,) = _frames(held)
    assert frame["choices"][0]["delta"] == {}
    assert frame["choices"][0]["logprobs"]["content"][0]["token"] == "h"
    assert frame["usage"] is None
    step: list[Event] = [
        logprobs,
        ReasoningDelta(0, "hm"),
        TextDelta(0, "hi"),
        ToolCallStart(0, 0, "call_1", "w"),
        ToolCallArguments(0, 0, "{}"),
        ToolCallEnd(0, 0),
        ChoiceFinished(0, "tool_calls", tool_calls=True),
    ]
    writes = chunks.render(step)
    assert len(writes) == 1  # one write per engine step
    frames = _frames(writes)
    deltas = [f["choices"][0]["delta"] for f in frames]
    assert deltas == [
        {"reasoning_content": "hm"},
        {"content": "hi"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "function": {"name": "w", "arguments": ""},
                    "id": "call_1",
                    "type": "function",
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
        {},
    ]
    assert [f["choices"][0]["logprobs"] is not None for f in frames] == [
        True,
        False,
        False,
        False,
        False,
    ]
    assert [f["choices"][0]["finish_reason"] for f in frames][-1] == "tool_calls"
    ending = chunks.render([Usage(3, 4, 1)])
    assert ending[-1] == "data: [DONE]\n\n"
    (usage,) = _frames(ending)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
