"""POST /v1/responses and GET /v1/responses/{id} through a spawned server with the real
``openai`` client: text, streaming events, chained turns, the store, structured output and
the errors (tools are in test_responses_tools.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

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


def test_text_response_has_text_usage_and_status(client: openai.OpenAI) -> None:
    response = _create(client)
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.model == MODEL
    assert response.output_text
    assert response.output[0].type == "message"
    assert response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage is not None
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens <= 16
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.error is None
    assert response.max_output_tokens == 16
    assert response.temperature == 0


def test_instructions_are_the_system_message(client: openai.OpenAI) -> None:
    # SmolLM2's template adds its own system prompt when there is none: compare with the chat
    # request that carries the instructions as its system message.
    instructions = (
        "You are a patient geography teacher. Answer every question about places, capitals "
        "and countries in one short, friendly sentence, and never add anything after it."
    )
    plain = _create(client, max_output_tokens=1)
    instructed = _create(client, max_output_tokens=1, instructions=instructions)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=1,
    )
    assert plain.usage is not None and instructed.usage is not None and chat.usage is not None
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens
    assert instructed.usage.input_tokens > plain.usage.input_tokens
    assert instructed.instructions == instructions


def test_message_items_are_the_same_prompt_as_a_string(client: openai.OpenAI) -> None:
    plain = _create(client, max_output_tokens=1)
    typed = _create(
        client,
        max_output_tokens=1,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            }
        ],
    )
    bare = _create(client, max_output_tokens=1, input=[{"role": "user", "content": QUESTION}])
    assert plain.usage is not None and typed.usage is not None and bare.usage is not None
    assert typed.usage.input_tokens == bare.usage.input_tokens == plain.usage.input_tokens
    conversation = _create(
        client,
        max_output_tokens=1,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": QUESTION},
        ],
    )
    assert conversation.usage is not None
    assert conversation.usage.input_tokens > plain.usage.input_tokens


def test_stream_events_are_ordered_and_match_the_json_answer(client: openai.OpenAI) -> None:
    expected = _create(client, max_output_tokens=24)
    events = _stream(client, max_output_tokens=24)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = "response.completed" if expected.status == "completed" else "response.incomplete"
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    created = events[0]
    assert created.type == "response.created"
    assert created.response.status == "in_progress" and created.response.output == []
    text = "".join(d.delta for d in deltas)
    done = events[-1]
    assert done.type == final
    assert isinstance(
        done,
        openai.types.responses.ResponseCompletedEvent
        | openai.types.responses.ResponseIncompleteEvent,
    )
    assert text == done.response.output_text == expected.output_text
    assert done.response.usage == expected.usage
    item_ids = {d.item_id for d in deltas}
    assert item_ids == {done.response.output[0].id}
    stored = client.responses.retrieve(done.response.id)  # streamed responses are stored too
    assert stored.output_text == text and stored.status == done.response.status


def test_previous_response_id_replays_the_earlier_turn(client: openai.OpenAI) -> None:
    first = _create(client, input="My name is Ada. Remember it.", max_output_tokens=12)
    second = _create(
        client, input="What is my name?", previous_response_id=first.id, max_output_tokens=12
    )
    alone = _create(client, input="What is my name?", max_output_tokens=12)
    assert first.usage is not None and second.usage is not None and alone.usage is not None
    earlier = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > earlier
    assert second.usage.input_tokens > alone.usage.input_tokens
    assert second.previous_response_id == first.id
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id
    assert stored.output_text == first.output_text
    assert stored.usage == first.usage


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = _create(client, store=False, max_output_tokens=2)
    assert response.model_dump()["store"] is False  # not a field of the client's model
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        _create(client, previous_response_id=response.id)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "previous_response_id"


def test_malformed_and_unknown_previous_response_ids(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        _create(client, previous_response_id="not-a-response-id")
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["param"] == "previous_response_id"
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        _create(client, previous_response_id="resp_" + "0" * 32)
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["type"] == "invalid_request_error"
    assert missing.value.body["code"] == "previous_response_not_found"


def test_json_schema_text_format_is_followed(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = _create(
        client,
        input="Describe a person as JSON.",
        max_output_tokens=80,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
    )
    assert response.status == "completed"
    data = json.loads(response.output_text)
    assert set(data) == {"name", "age"}
    assert isinstance(data["name"], str) and isinstance(data["age"], int)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_cut_is_incomplete(client: openai.OpenAI) -> None:
    response = _create(client, input="Tell me a long story.", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 2


def test_raw_stream_frames_name_their_event_and_have_no_done(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.api_url}/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    assert "[DONE]" not in raw
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]


def test_unknown_field_and_unknown_get_are_openai_errors(server: ServerProcess) -> None:
    reply = httpx.post(f"{server.api_url}/responses", json={"input": "hi", "bogus": 1}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "bogus"
    # The chat path's refusals name the Responses field the client sent.
    too_long = {"input": "hi", "max_output_tokens": 10**6}
    reply = httpx.post(f"{server.api_url}/responses", json=too_long, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_output_tokens"
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    reply = httpx.get(f"{server.api_url}/responses/resp_{'a' * 32}", timeout=30)
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_the_second_turn_reuses_the_first_from_the_prefix_cache(client: openai.OpenAI) -> None:
    # A long fixed preamble, as an agent's instructions and tools are: turn 2 replays turn 1.
    rules = " ".join(f"Rule {i}: keep answer {i} short and plain." for i in range(120))
    first_input: list[dict[str, Any]] = [
        {"role": "developer", "content": rules},
        {"role": "user", "content": QUESTION},
    ]
    first = _create(client, input=first_input, max_output_tokens=8, store=False)
    assert first.usage is not None and first.usage.input_tokens > 1000
    second_input = [
        *first_input,
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And of Italy?"},
    ]
    second = _create(client, input=second_input, max_output_tokens=8, store=False)
    assert second.usage is not None
    # The whole first prompt is reused but for the last part-chunk (llama.cpp's grain: 64).
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 64


def test_a_prompt_over_the_slot_context_is_a_400_naming_the_flag(client: openai.OpenAI) -> None:
    long_text = "word " * 6000  # over the 4096 tokens a slot of this server holds
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input=long_text, max_output_tokens=4)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert "--ctx-size" in error["message"] and "4096" in error["message"]


def test_top_logprobs_score_the_output_text(client: openai.OpenAI) -> None:
    response = _create(
        client, max_output_tokens=4, top_logprobs=2, include=["message.output_text.logprobs"]
    )
    message = response.output[0]
    assert message.type == "message"
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs
    assert response.usage is not None
    assert len(part.logprobs) == response.usage.output_tokens
    assert all(len(score.top_logprobs) == 2 for score in part.logprobs)
