"""POST /v1/messages and /v1/messages/count_tokens through a spawned server with the real
``anthropic`` client: text, the event stream, tools, stop reasons, usage and the prefix
cache, both ways of sending the key, Anthropic-shaped errors, and a disconnect that frees
its slot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY = "test-key"
# Any: the SDK types its parameters as TypedDicts, which plain dict literals are not.
HI: Any = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("anthropic"), "--slots", "2", "--api-key", KEY)
    yield proc
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def _create(client: anthropic.Anthropic, **kwargs: Any) -> anthropic.types.Message:
    # The SDK's signature no longer lists the sampling fields; the API still takes them.
    params: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": HI,
        "extra_body": GREEDY,
    } | kwargs
    message: anthropic.types.Message = client.messages.create(**params)
    return message


def _post(server: ServerProcess, body: Any, path: str = "/v1/messages") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


def _assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return str(body["error"]["message"])


def test_a_message_has_text_usage_and_end_turn(client: anthropic.Anthropic) -> None:
    # Greedy: a sampled reply may run past max_tokens and end with "max_tokens" instead.
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=256, messages=HI, extra_body=GREEDY
    )
    assert raw.headers["request-id"]
    message = raw.parse()
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert message.usage.cache_creation_input_tokens == 0


def test_the_stream_has_anthropics_event_sequence(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=HI, extra_body=GREEDY, system="Be brief."
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    text_events = [e for e in events if e.type == "content_block_delta"]
    assert text_events and all(e.delta.type == "text_delta" for e in text_events)
    block = kinds.index("content_block_start")
    assert kinds.index("content_block_stop") > block
    start = events[0]
    assert start.type == "message_start" and start.message.content == []
    assert start.message.usage.input_tokens > 0
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    streamed = "".join(e.delta.text for e in text_events if e.delta.type == "text_delta")
    assert final.content[0].type == "text" and final.content[0].text == streamed
    # Greedy decoding: the stream and the JSON answer carry the same text.
    whole = _create(client, max_tokens=12, system="Be brief.")
    assert whole.content[0].type == "text" and whole.content[0].text == streamed


def test_the_raw_stream_has_event_lines_and_a_ping(server: ServerProcess) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True}
    headers = {"x-api-key": KEY}
    url = f"{server.base_url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names
    delta = data[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


def test_a_forced_tool_gives_a_tool_use_block_matching_the_schema(
    client: anthropic.Anthropic,
) -> None:
    message = _create(
        client,
        max_tokens=80,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_a_forced_tool_streams_input_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=80,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and any(d.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])


def test_server_tools_are_left_out_and_none_turns_tools_off(client: anthropic.Anthropic) -> None:
    message = _create(
        client,
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
        tool_choice={"type": "none"},
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in message.content)


def test_a_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
    ]
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": [{"type": "text", "text": "Sunny, 24 degrees.", "cache_control": None}],
    }
    ok = [*history, {"role": "user", "content": [result]}]
    message = _create(client, max_tokens=24, messages=ok, tools=[WEATHER])
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    failed = [
        *history,
        {
            "role": "user",
            "content": [
                {**result, "content": "timeout", "is_error": True},
                {"type": "text", "text": "Try again?"},
            ],
        },
    ]
    conversations: list[Any] = [[*history, {"role": "user", "content": "x"}], ok, failed]
    counts = [
        client.messages.count_tokens(model=MODEL, messages=m, tools=[WEATHER]).input_tokens
        for m in conversations
    ]
    # The result's text reaches the prompt; so do the error mark and the text after it.
    assert counts[1] > counts[0] and counts[2] > counts[0]


def test_count_tokens_is_the_input_of_a_create(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    system = "You answer in one short sentence."
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system=system)
    message = _create(client, messages=messages, system=system, max_tokens=4)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_stop_sequences_end_with_stop_sequence(client: anthropic.Anthropic) -> None:
    plain = _create(client, max_tokens=16)
    assert plain.content[0].type == "text"
    words = plain.content[0].text.split()
    assert len(words) >= 3
    stop = words[2]
    message = _create(client, max_tokens=16, stop_sequences=[stop, "zzz-never"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].type == "text" and stop not in message.content[0].text


def test_max_tokens_ends_with_max_tokens(client: anthropic.Anthropic) -> None:
    message = _create(client, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_repeated_long_prompt_reads_the_cache(client: anthropic.Anthropic) -> None:
    system = [
        {
            "type": "text",
            "text": "You are a careful assistant. " * 60,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    first = _create(client, system=system, max_tokens=2)
    second = _create(client, system=system, max_tokens=2)
    assert (second.usage.cache_read_input_tokens or 0) > 0
    total = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert total == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


def test_the_key_as_x_api_key_or_bearer(server: ServerProcess) -> None:
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=HI).content is not None
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert refused.value.status_code == 401
    missing = httpx.post(f"{server.base_url}/v1/messages", json={}, timeout=10)
    _assert_anthropic_error(missing, 401, "authentication_error")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL, "messages": HI}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "Hi"}]}, "role"),
        ({"max_tokens": "many", "messages": HI}, "max_tokens"),
        ({"max_tokens": 4, "messages": "Hi"}, "messages"),
        ({"max_tokens": 4, "messages": HI, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 4, "messages": HI, "frequency_penalty": 1}, "frequency_penalty"),
        ({"max_tokens": 4, "messages": [], "stream": True}, "messages"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                            }
                        ],
                    }
                ],
            },
            "image",
        ),
        ({"max_tokens": 4, "messages": HI, "thinking": {"type": "enabled"}}, "budget_tokens"),
        (
            {
                "max_tokens": 2048,
                "messages": HI,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "--reasoning-parser",
        ),
        ({"max_tokens": 4, "messages": HI, "tool_choice": {"type": "tool"}}, "name"),
        ({"max_tokens": 4, "messages": HI, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ],
)
def test_malformed_bodies_get_anthropic_400s(
    server: ServerProcess, body: dict[str, Any], words: str
) -> None:
    message = _assert_anthropic_error(_post(server, body), 400, "invalid_request_error")
    assert words in message


def test_invalid_json_and_unknown_things(server: ServerProcess) -> None:
    message = _assert_anthropic_error(_post(server, b"{not json"), 400, "invalid_request_error")
    assert "JSON" in message
    unknown_model = {"model": "nope", "max_tokens": 4, "messages": HI}
    _assert_anthropic_error(_post(server, unknown_model), 404, "not_found_error")
    _assert_anthropic_error(_post(server, {}, "/v1/messages/nope"), 404, "not_found_error")
    too_long = {"max_tokens": 100_000, "messages": HI}
    message = _assert_anthropic_error(_post(server, too_long), 400, "invalid_request_error")
    assert message.startswith("input length and `max_tokens` exceed context limit:")
    counted = _post(server, {"messages": HI}, "/v1/messages/count_tokens")
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    # The OpenAI routes keep OpenAI's shape.
    chat = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"messages": []},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert chat.status_code == 400 and "type" not in chat.json()


def test_a_streaming_disconnect_frees_the_slot(server: ServerProcess) -> None:
    slots = f"{server.base_url}/v1/slots"

    def stats() -> dict[str, Any]:
        return dict(httpx.get(slots, headers={"x-api-key": KEY}, timeout=10).json())

    aborted = stats()["requests_aborted"]
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        # Greedy, this prompt runs to max_tokens: a sampled reply may end before the test looks.
        "messages": [
            {"role": "user", "content": "List the numbers from 1 to 1000, separated by commas."}
        ],
        "temperature": 0.0,
        "stream": True,
    }
    url = f"{server.base_url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers={"x-api-key": KEY}, timeout=60) as response:
        lines = response.iter_lines()  # not a for loop: leaving one would close the response
        while next(lines) != "event: content_block_delta":
            pass
        # The stats are a snapshot published after each engine step: wait for this one's.
        assert wait_until(lambda: any(s["state"] == "generating" for s in stats()["slots"]))
    assert wait_until(lambda: stats()["requests_aborted"] == aborted + 1)
    assert wait_until(lambda: all(s["state"] == "free" for s in stats()["slots"]))
