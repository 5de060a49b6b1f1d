"""What the tool-call parsers hand the engine for a set of tools: the generic parser's system
prompt, and the grammars, run through a real llguidance matcher on the embedded model's vocab
(good calls taken, bad ones refused, the argument schemas closed)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance.llamacpp import lltokenizer_from_vocab

from slotserve.engine.decoding.structured_output import closed_objects
from slotserve.protocol.tool_parsers import (
    TOOL_PARSERS,
    FunctionTool,
    generic_system_prompt,
    get_tool_parser,
    parser_for_template,
)
from slotserve.runners.llama_cpp.backend import init_llama_backend

WEATHER = FunctionTool(
    "get_weather",
    "Current weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
NOW = FunctionTool("now", "The time", {})


def test_generic_system_prompt_lists_the_tools_and_the_format() -> None:
    tools = [WEATHER, NOW]
    auto = generic_system_prompt(tools, required=False)
    assert "get_weather: Current weather in a city" in auto
    assert '"city": {"type": "string"}' in auto
    assert '{"tool_calls": [' in auto and '{"response": ' in auto
    required = generic_system_prompt(tools, required=True)
    assert '{"tool_calls": [' in required and '{"response": ' not in required


# parser → (two calls, a get_weather call, a now call, a wrong name, a wrong argument type)
GRAMMAR_TEXTS: dict[str, tuple[str, str, str, str, str]] = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "now", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        '{"name": "now", "parameters": {}}',
        '{"name": "later", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": "3"}}',
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS][{"name": "now", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "Now", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ["Paris"]}}]',
    ),
    "pythonic": (
        '[get_weather(city="Paris", days=2), now()]',
        "[get_weather(city='Paris')]",
        "[now()]",
        '[get_wether(city="Paris")]',
        "[get_weather(city=2)]",
    ),
    "generic": (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]}',
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        '{"tool_calls": [{"name": "now", "arguments": {}}]}',
        '{"tool_calls": [{"name": "then", "arguments": {}}]}',
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": null}}]}',
    ),
}


@pytest.fixture(scope="module")
def vocab_model(model_path: Path) -> Iterator[Any]:
    """The embedded model loaded for its vocabulary and metadata only (no weights)."""
    init_llama_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    assert model
    yield model
    llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def tokenizer(vocab_model: Any) -> LLTokenizer:
    with warnings.catch_warnings():
        # llguidance's helper calls llama_token_get_attr, deprecated in llama-cpp-python: one
        # warning per vocabulary entry otherwise.
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(llama_cpp.llama_model_get_vocab(vocab_model))


def test_the_embedded_model_gets_the_generic_parser(vocab_model: Any) -> None:
    template = llama_cpp.llama_model_chat_template(vocab_model, None)
    assert template and b"<|im_start|>" in template
    assert parser_for_template(template.decode()).name == "generic"


def _accepts(tokenizer: LLTokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    consumed = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return bool(consumed and matcher.is_accepting())


@pytest.mark.parametrize("parser_name", TOOL_PARSERS)
def test_grammar_takes_good_calls_and_refuses_bad_ones(
    tokenizer: LLTokenizer, parser_name: str
) -> None:
    parser = get_tool_parser(parser_name)
    two, one, other, wrong_name, wrong_type = GRAMMAR_TEXTS[parser_name]
    parallel = parser.grammar([WEATHER, NOW], required=True, parallel=True)
    single = parser.grammar([WEATHER, NOW], required=True, parallel=False)
    assert LLMatcher.validate_grammar(parallel) == ""
    assert LLMatcher.validate_grammar(single) == ""
    assert _accepts(tokenizer, parallel, two)
    assert _accepts(tokenizer, parallel, one)
    assert _accepts(tokenizer, single, one)
    assert _accepts(tokenizer, single, other)
    assert not _accepts(tokenizer, single, two)
    assert not _accepts(tokenizer, parallel, wrong_name)
    assert not _accepts(tokenizer, parallel, wrong_type)
    assert not _accepts(tokenizer, parallel, "The weather is fine.")
    if parser_name != "pythonic":  # keywords outside the schema are refused by the syntax
        invented = one.replace('"Paris"', '"Paris", "mood": "sunny"')
        assert invented != one and not _accepts(tokenizer, parallel, invented)
    # What the grammar lets through, the parser reads as the calls it spells.
    assert [c.name for c in parser.parse(two).tool_calls] == ["get_weather", "now"]


@pytest.mark.parametrize("parser_name", TOOL_PARSERS)
def test_grammar_for_a_named_function(tokenizer: LLTokenizer, parser_name: str) -> None:
    _, weather, now, _, _ = GRAMMAR_TEXTS[parser_name]
    named = get_tool_parser(parser_name).grammar([WEATHER], required=True, parallel=False)
    assert _accepts(tokenizer, named, weather)
    assert not _accepts(tokenizer, named, now)


def test_grammar_json_is_spaced_as_json_dumps_writes_it(tokenizer: LLTokenizer) -> None:
    grammar = get_tool_parser("hermes").grammar([NOW], required=True, parallel=False)
    assert _accepts(tokenizer, grammar, GRAMMAR_TEXTS["hermes"][2])
    compact = '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'
    padded = '<tool_call>\n{"name": "now", "arguments": {}\n\n\n}\n</tool_call>'
    assert not _accepts(tokenizer, grammar, compact)
    assert not _accepts(tokenizer, grammar, padded)


def test_generic_grammar_for_auto_allows_an_answer(tokenizer: LLTokenizer) -> None:
    parser = get_tool_parser("generic")
    auto = parser.grammar([WEATHER, NOW], required=False, parallel=True)
    required = parser.grammar([WEATHER, NOW], required=True, parallel=True)
    answer = '{"response": "It is sunny."}'
    assert _accepts(tokenizer, auto, answer)
    assert _accepts(tokenizer, auto, GRAMMAR_TEXTS["generic"][0])
    assert not _accepts(tokenizer, required, answer)
    assert parser.parse(answer).content == "It is sunny."


@pytest.mark.parametrize("parser_name", [n for n in TOOL_PARSERS if n != "generic"])
def test_only_the_generic_grammar_allows_no_call(parser_name: str) -> None:
    with pytest.raises(ValueError, match="optional call"):
        get_tool_parser(parser_name).grammar([WEATHER], required=False, parallel=False)


def test_grammar_needs_a_tool() -> None:
    for name in TOOL_PARSERS:
        with pytest.raises(ValueError, match="at least one tool"):
            get_tool_parser(name).grammar([], required=True, parallel=False)


def test_argument_schemas_are_closed_without_touching_names_or_data() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
            "mode": {"enum": [{"properties": {}}]},
        },
    }
    assert closed_objects(schema) == {
        "type": "object",
        "properties": {
            "properties": {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "additionalProperties": False,
            },
            "mode": {"enum": [{"properties": {}}]},
        },
        "additionalProperties": False,
    }
    open_schema = {"type": "object", "properties": {}, "additionalProperties": True}
    assert closed_objects(open_schema) == open_schema
