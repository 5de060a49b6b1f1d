"""POST /v1/responses with tools through a spawned server with the real ``openai`` client: a
required tool choice, a Codex-shaped request, namespaced functions and custom free-form tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import ServerProcess, start_server, stop_server
from tests.server.responses_helpers import MODEL, QUESTION, _create, _stream


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("responses"), "--slots", "2")
    yield proc
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK_WEATHER = "What is the weather in Paris?"


def test_required_tool_choice_gives_a_function_call(client: openai.OpenAI) -> None:
    # One call only: with parallel calls allowed the 135M model repeats the call until cut off.
    tools: Any = {"tools": [WEATHER_TOOL], "parallel_tool_calls": False, "max_output_tokens": 60}
    response = _create(client, input=ASK_WEATHER, tool_choice="required", **tools)
    assert response.status == "completed"
    call = response.output[0]
    assert call.type == "function_call" and len(response.output) == 1
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict)
    assert call.call_id and call.id and call.id.startswith("fc_")

    events = _stream(client, input=ASK_WEATHER, tool_choice="required", **tools)
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = events[-1]
    assert done.type == "response.completed"
    streamed = done.response.output[0]
    assert streamed.type == "function_call"
    assert "".join(fragments) == streamed.arguments == call.arguments

    # The result goes back as the next turn's input; replaying the earlier turn by id or by
    # sending its items again is the same prompt.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    chained = _create(client, previous_response_id=response.id, input=[result], **tools)
    echoed = _create(
        client,
        input=[
            {"role": "user", "content": ASK_WEATHER},
            call.model_dump(exclude_none=True),
            result,
        ],
        **tools,
    )
    assert chained.usage is not None and echoed.usage is not None and response.usage is not None
    assert chained.usage.input_tokens == echoed.usage.input_tokens > response.usage.input_tokens
    assert [i.type for i in chained.output] == [i.type for i in echoed.output]
    assert chained.output_text == echoed.output_text


# What Codex CLI sends, in small: a namespace of functions, a hosted tool the server cannot
# run, a free-form tool, developer messages and a history with calls and reasoning.
NAMESPACE_TOOL: dict[str, Any] = {
    "type": "namespace",
    "name": "forecast",
    "description": "Weather services.",
    "tools": [WEATHER_TOOL | {"strict": False}],
}
PATCH_TOOL: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Write a short note.",
    "format": {"type": "text"},
}
HOSTED_TOOL: dict[str, Any] = {"type": "web_search", "external_web_access": False}
_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def _codex_request(**fields: Any) -> dict[str, Any]:
    developer = [{"type": "input_text", "text": "You are a coding agent. Answer briefly."}]
    history: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": developer},
        {"type": "message", "role": "developer", "content": "Sandbox: read-only."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "namespace": "forecast",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    return {
        "model": MODEL,
        "input": history,
        "tools": [WEATHER_TOOL | {"name": "lookup"}, NAMESPACE_TOOL, HOSTED_TOOL, PATCH_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "thread-1",
        "max_output_tokens": 16,
        "temperature": 0,
        "extra_body": {"client_metadata": {"session_id": "s-1"}},
    } | fields


def test_a_codex_shaped_request_is_served_and_its_events_validate(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(**_codex_request())
    Response.model_validate(response.model_dump())
    assert response.status in ("completed", "incomplete")
    assert response.store is False and response.prompt_cache_key == "thread-1"
    assert [t.type for t in response.tools] == ["function", "namespace", "web_search", "custom"]
    with pytest.raises(openai.NotFoundError):  # store false: nothing to retrieve
        client.responses.retrieve(response.id)

    events = list(client.responses.create(**_codex_request(stream=True)))
    checked = [_EVENT.validate_python(e.model_dump()) for e in events]
    assert [e.sequence_number for e in checked] == list(range(len(checked)))
    assert checked[0].type == "response.created" and checked[1].type == "response.in_progress"
    done = checked[-1]
    assert done.type in ("response.completed", "response.incomplete")
    assert done.response.usage is not None


def test_a_call_to_a_namespaced_function_comes_back_namespaced(client: openai.OpenAI) -> None:
    tools: Any = {"tools": [NAMESPACE_TOOL, HOSTED_TOOL], "parallel_tool_calls": False}
    response = _create(
        client, input=ASK_WEATHER, tool_choice="required", max_output_tokens=60, **tools
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert call.name == "get_weather" and call.namespace == "forecast"
    assert isinstance(json.loads(call.arguments), dict)

    events = _stream(
        client, input=ASK_WEATHER, tool_choice="required", max_output_tokens=60, **tools
    )
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.namespace == "forecast"


def test_a_custom_tool_call_is_free_form_input(client: openai.OpenAI) -> None:
    tools: Any = {"tools": [PATCH_TOOL, HOSTED_TOOL], "parallel_tool_calls": False}
    ask = "Write the note 'hello'."
    response = _create(client, input=ask, tool_choice="required", max_output_tokens=40, **tools)
    (call,) = response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert isinstance(call.input, str) and call.call_id

    events = _stream(client, input=ask, tool_choice="required", max_output_tokens=40, **tools)
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == call.input  # greedy: the same call

    # Its result goes back as a custom_tool_call_output item.
    output = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "written"}
    history = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), output]
    follow = _create(client, input=history, max_output_tokens=8, **tools)
    assert follow.status in ("completed", "incomplete")
