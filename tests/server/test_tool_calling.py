"""Tool calling through the real server and the real ``openai`` client (SPEC S1).

The embedded SmolLM2's template knows nothing of tools, so by default the server uses the
generic format (tools described in a system message, JSON output constrained); with
``--tool-call-parser hermes`` the forced calls are ``<tool_call>`` blocks parsed back. Both
runners are covered; forced calls must always parse and match their schema, even at 135M."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.conftest import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time."},
}
ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]

CONFIGS = {
    "llama.cpp": ("--runner", "llama.cpp"),
    "torch": ("--runner", "torch"),
    "hermes": ("--runner", "llama.cpp", "--tool-call-parser", "hermes"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = CONFIGS[request.param]
    proc = start_server(tmp_path_factory.mktemp("tools"), *args, "--slots", "2")
    yield proc
    stop_server(proc)


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def _check_weather_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 30
    assert arguments["unit"] in ("celsius", "fahrenheit")
    return dict(arguments)


def test_required_gives_a_call_matching_the_schema(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    _check_weather_call(choice.message.tool_calls[0])


def test_a_named_function_is_called_and_finishes_with_stop(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced named function
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]  # type: ignore[union-attr]
    assert calls[0].function.arguments == "{}"  # type: ignore[union-attr]


def test_streamed_call_deltas_concatenate_to_the_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 120,
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert whole
    pieces: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = pieces.setdefault(delta.index, {"ids": [], "names": [], "arguments": ""})
            if delta.id:
                entry["ids"].append(delta.id)
            if delta.function and delta.function.name:
                entry["names"].append(delta.function.name)
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    assert list(pieces) == [0]
    assert len(pieces[0]["ids"]) == 1 and pieces[0]["names"] == ["get_weather"]
    assert pieces[0]["arguments"] == whole[0].function.arguments


def test_a_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0
    )
    calls = first.choices[0].message.tool_calls or []
    assert calls
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},  # type: ignore[union-attr]
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18}'},
    ]
    result = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=40
    )
    choice = result.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    usage = result.usage
    assert usage is not None and first.usage is not None
    assert usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went in


def test_auto_and_none_never_fail(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60
    )
    choice = auto.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    none = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=10,
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{not json"},
                            }
                        ],
                    },
                ],
                "tools": [WEATHER],
            },
            "messages",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
    ],
)
def test_bad_tool_requests_get_a_400(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"messages": ASK, "max_tokens": 4, **body},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
