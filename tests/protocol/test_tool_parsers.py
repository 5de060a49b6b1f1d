"""Tool-call parsers on canned model text: whole and streamed in every chunking, cut-off and junk
output, and which parser a chat template gets (the prompt and grammars they hand the engine are
in test_tool_grammars.py)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.protocol.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    FunctionTool,
    ParsedMessage,
    StreamEvent,
    ToolCallDelta,
    get_tool_parser,
    parser_for_template,
)
from slotserve.protocol.tool_parsers.events import collect

Calls = list[tuple[str, str]]

# (parser, model output, expected content, expected (name, arguments) calls). Every case here
# must also stream to the same result in every chunking.
CASES: list[tuple[str, str, str, Calls]] = [
    # hermes
    (
        "hermes",
        "Let me check the weather.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "Let me check the weather.",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [("now", "{}")]),
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>',
        "",
        [("f", '{"x": [1, 2]}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"q": "cats"}, "name": "search"}\n</tool_call>',
        "",
        [("search", '{"q": "cats"}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a } b \\" </tool_call> é"}}\n'
        "</tool_call>",
        "",
        [("echo", '{"text": "a } b \\" </tool_call> é"}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": null}]}}',
        "",
        [("f", '{"a": [1, {"b": null}]}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.',
        "\nDone.",
        [("f", "{}")],
    ),
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": get_weather}\n</tool_call> Anything else?',
        'Sure.\n<tool_call>\n{"name": get_weather}\n</tool_call> Anything else?',
        [],
    ),
    (
        "hermes",
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\nbroken\n'
        "</tool_call>",
        "\n<tool_call>\nbroken\n</tool_call>",
        [("f", "{}")],
    ),
    ("hermes", "Use a <tool> or a <tool_", "Use a <tool> or a <tool_", []),
    ("hermes", "The answer is 42.\n\n", "The answer is 42.\n\n", []),
    # llama3_json
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    (
        "llama3_json",
        'Checking. <|python_tag|>{"name": "now", "parameters": {}}',
        "Checking.",
        [("now", "{}")],
    ),
    ("llama3_json", ' {"name": "f", "parameters": "{\\"x\\": 1}"}', "", [("f", '{"x": 1}')]),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    # mistral
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        "",
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    (
        "mistral",
        'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Let me look.",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "now"}', "", [("now", "{}")]),
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("mistral", "see [TOOL", "see [TOOL", []),
    # pythonic
    (
        "pythonic",
        "[get_weather(city=\"Paris\", unit='celsius'), now()]",
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("now", "{}")],
    ),
    (
        "pythonic",
        ' [search(q="a, b) [c]", limit=5, ratio=-0.5, tags=["x", "é"], '
        'opts={"deep": True, "n": None}, pair=(1, 2))]\n',
        "",
        [
            (
                "search",
                '{"q": "a, b) [c]", "limit": 5, "ratio": -0.5, "tags": ["x", "é"], '
                '"opts": {"deep": true, "n": null}, "pair": [1, 2]}',
            )
        ],
    ),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
    ("pythonic", "[1] A footnote.", "[1] A footnote.", []),
    # generic
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    ("generic", '{"tool_call": {"name": "now"}}', "", [("now", "{}")]),
    (
        "generic",
        '{"response": "Hello, \\"world\\"!\\n\\u00e9 \\ud83d\\ude00 \\\\"}',
        'Hello, "world"!\né 😀 \\',
        [],
    ),
    ("generic", '\n{ "response" : "x" }\n', "x", []),
    ("generic", '{"response": "cut off', "cut off", []),
    ("generic", "Plain answer.", "Plain answer.", []),
    ("generic", ' {"other": 1}', ' {"other": 1}', []),
]


def _summary(message: ParsedMessage) -> tuple[str, Calls]:
    return message.content, [(c.name, c.arguments) for c in message.tool_calls]


def _stream(parser_name: str, chunks: list[str]) -> list[StreamEvent]:
    stream = get_tool_parser(parser_name).stream()
    events: list[StreamEvent] = []
    for chunk in chunks:
        events += stream.feed(chunk)
    return events + stream.finish()


def _chunkings(text: str) -> Iterator[list[str]]:
    for size in (1, 2, 3, 7):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    if len(text) <= 400:
        for cut in range(1, len(text)):
            yield [text[:cut], text[cut:]]


def _check_ids(events: list[StreamEvent]) -> None:
    """Each call's first delta carries its id and name, and no later delta does."""
    ids: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.index not in ids:
                assert event.id is not None and event.name is not None
                assert re.fullmatch(r"call_[0-9a-f]{24}", event.id)
                ids[event.index] = event.id
            else:
                assert event.id is None and event.name is None
    assert sorted(ids) == list(range(len(ids)))
    assert len(set(ids.values())) == len(ids)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
def test_parse(parser_name: str, text: str, content: str, calls: Calls) -> None:
    message = get_tool_parser(parser_name).parse(text)
    assert _summary(message) == (content, calls)
    assert len({c.id for c in message.tool_calls}) == len(calls)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
def test_stream_matches_parse_in_every_chunking(
    parser_name: str, text: str, content: str, calls: Calls
) -> None:
    for chunks in _chunkings(text):
        events = _stream(parser_name, chunks)
        _check_ids(events)
        assert _summary(collect(events)) == (content, calls), chunks


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_stream_matches_parse_in_random_chunkings(
    case: tuple[str, str, str, Calls], cuts: list[int]
) -> None:
    parser_name, text, content, calls = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    assert _summary(collect(_stream(parser_name, chunks))) == (content, calls)


def test_tag_split_across_chunks_is_held_back_then_read() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool") == [ContentDelta("Hi")]
    events = stream.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool')
    events += stream.feed("_call>")
    events += stream.finish()
    assert not any(isinstance(e, ContentDelta) for e in events)
    assert _summary(collect(events)) == ("", [("f", '{"a": 1}')])


def test_content_goes_out_as_soon_as_it_cannot_open_a_call() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert stream.feed("ld <") == [ContentDelta("ld")]
    assert stream.feed("b>") == [ContentDelta(" <b>")]
    assert stream.finish() == []


def test_arguments_stream_as_they_arrive() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = get_tool_parser("hermes").stream()
    events = [e for i in range(0, len(text), 4) for e in stream.feed(text[i : i + 4])]
    events += stream.finish()
    first, *fragments = events
    assert isinstance(first, ToolCallDelta)
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert all(isinstance(f, ToolCallDelta) and f.id is None for f in fragments)
    assert len(fragments) > 3  # sent as the text came, not once the call was complete
    assert "".join(f.arguments for f in fragments if isinstance(f, ToolCallDelta)) == (
        '{"city": "Paris"}'
    )


# Outputs where a call is shown before it turns out broken: a stream cannot take back what it
# sent, but the text must still come back as content.
BROKEN_LATE = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {}} and some words'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, oops]'),
    ("pythonic", '[f("positional")]'),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}], "extra": 1}'),
]


@pytest.mark.parametrize(("parser_name", "text"), BROKEN_LATE)
def test_a_call_broken_late_comes_back_as_content(parser_name: str, text: str) -> None:
    assert _summary(get_tool_parser(parser_name).parse(text)) == (text, [])
    for size in (1, 5):
        events = _stream(parser_name, [text[i : i + size] for i in range(0, len(text), size)])
        assert collect(events).content == text


@pytest.mark.parametrize("parser_name", [n for n in TOOL_PARSERS if n != "generic"])
def test_cut_off_output_is_never_lost(parser_name: str) -> None:
    """Every prefix (an output stopped anywhere): parsing never raises, and text that makes no
    call comes back whole, parsed or streamed."""
    texts = [text for name, text, _, _ in CASES if name == parser_name]
    texts += [text for name, text in BROKEN_LATE if name == parser_name]
    for text in texts:
        for end in range(len(text) + 1):
            prefix = text[:end]
            message = get_tool_parser(parser_name).parse(prefix)
            if not message.tool_calls:
                assert message.content == prefix
                streamed = collect(_stream(parser_name, list(prefix)))
                assert streamed.content == prefix


def test_generic_cut_off_output_never_raises() -> None:
    for name, text, _, _ in CASES:
        if name == "generic":
            for end in range(len(text) + 1):
                get_tool_parser("generic").parse(text[:end])
                _stream("generic", list(text[:end]))


@pytest.mark.parametrize("parser_name", TOOL_PARSERS)
@pytest.mark.parametrize(
    "junk",
    [
        "{" * 5000,
        "[" * 5000,
        '{"name": "f", "arguments": ' + "[" * 5000,
        '{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}",
        "[f(a=" + "[" * 5000 + "]" * 5000 + ")]",
        "\x00\ud800]})",
    ],
)
def test_junk_never_raises(parser_name: str, junk: str) -> None:
    parser = get_tool_parser(parser_name)
    for text in (junk, "<tool_call>" + junk, "[TOOL_CALLS]" + junk, '{"tool_call": ' + junk):
        parser.parse(text)


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="Unknown tool-call parser 'nope'") as info:
        get_tool_parser("nope")
    for name in TOOL_PARSERS:
        assert name in str(info.value)


QWEN_TEMPLATE = "{%- if tools %}<tools>{{ tool }}</tools> <tool_call>\n{...}\n</tool_call>"
LLAMA31_TEMPLATE = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' }}"
LLAMA32_TEMPLATE = (
    '<|start_header_id|>user<|end_header_id|>Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.'
)
PYTHONIC_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>[func_name1(params_name1=params_value1, "
    'params_name2=params_value2...), func_name2(params)] "parameters"'
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN_TEMPLATE, "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        (PYTHONIC_TEMPLATE, "pythonic"),
        ("{% for message in messages %}<|im_start|>{{ message['content'] }}", "generic"),
        (None, "generic"),
    ],
)
def test_parser_for_template(template: str | None, expected: str) -> None:
    assert parser_for_template(template).name == expected


def test_function_tool_without_parameters_gets_an_empty_object_schema() -> None:
    empty = {"type": "object", "properties": {}}
    assert FunctionTool("now", None, {}).parameters == empty
    tool = FunctionTool.from_openai({"type": "function", "function": {"name": "now"}})
    assert (tool.name, tool.description, tool.parameters) == ("now", None, empty)
