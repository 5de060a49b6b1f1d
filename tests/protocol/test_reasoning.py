"""Reasoning parsers on canned model text: whole, and streamed in every chunking."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.protocol.reasoning import REASONING_PARSERS, get_reasoning_parser

# (parser, model output, expected reasoning, expected content)
CASES: list[tuple[str, str, str | None, str]] = [
    (
        "qwen3",
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("qwen3", "\n<think>a\n\nb</think>c", "a\n\nb", "c"),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "  plain\n", None, "  plain\n"),
    ("qwen3", "<think>\nStill thinking when cut off\n", "Still thinking when cut off\n", ""),
    ("qwen3", "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("qwen3", "No tag here </think> then", None, "No tag here </think> then"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>x</think>y<think>z</think>", "x", "y<think>z</think>"),
    ("qwen3", "<think>a </thin b</think>\n", "a </thin b", ""),
    (
        "deepseek_r1",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>\nhmm\n</think>\nok", "hmm", "ok"),
    ("deepseek_r1", "Thinking, cut off\n\n", "Thinking, cut off\n\n", ""),
    ("deepseek_r1", "  <th", "  <th", ""),
    ("deepseek_r1", "</think>Just content", None, "Just content"),
    ("deepseek_r1", "a\n</b>\n</think>\n\n\nc\n", "a\n</b>", "c\n"),
    ("deepseek_r1", "", None, ""),
]


def _stream(name: str, chunks: list[str]) -> tuple[str | None, str]:
    stream = get_reasoning_parser(name).stream()
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
    assert all(kind in ("reasoning", "content") and piece for kind, piece in pieces)
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    content = "".join(piece for kind, piece in pieces if kind == "content")
    return reasoning or None, content


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_parse(name: str, text: str, reasoning: str | None, content: str) -> None:
    assert get_reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_stream_matches_parse_in_every_chunking(
    name: str, text: str, reasoning: str | None, content: str
) -> None:
    chunkings = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 7)]
    chunkings += [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    for chunks in chunkings:
        assert _stream(name, chunks) == (reasoning, content), chunks


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 80), max_size=10))
def test_stream_matches_parse_in_random_chunkings(
    case: tuple[str, str, str | None, str], cuts: list[int]
) -> None:
    name, text, reasoning, content = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    assert _stream(name, chunks) == (reasoning, content)


def test_reasoning_streams_while_it_arrives() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nStep one") == [("reasoning", "Step one")]
    assert stream.feed(".\n</th") == [("reasoning", ".")]
    assert stream.feed("ink>\n\nDone") == [("content", "Done")]
    assert stream.finish() == []


def test_qwen3_without_think_streams_content_at_once() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("Hello") == [("content", "Hello")]


def test_unknown_reasoning_parser_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="Unknown reasoning parser 'r2'") as info:
        get_reasoning_parser("r2")
    for name in REASONING_PARSERS:
        assert name in str(info.value)
