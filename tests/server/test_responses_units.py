"""The Responses API's pieces without a server: the request → chat translation, the stream
rendering of the pipeline's events (tool-call deltas, error frames), and the bounded store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from slotserve.engine.errors import InvalidRequestError
from slotserve.protocol.tool_parsers import ToolCall
from slotserve.server.events import (
    ChoiceFinished,
    Reply,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from slotserve.server.responses.chat_request import chat_request_of, input_messages
from slotserve.server.responses.output import assistant_turn, output_items, response_shell
from slotserve.server.responses.protocol import ResponsesRequest
from slotserve.server.responses.store import ResponseStore, StoredResponse
from slotserve.server.responses.stream import ResponseEventStream


def _shell(**fields: Any) -> dict[str, Any]:
    return response_shell(
        ResponsesRequest.model_validate({"input": "hi", **fields}), "resp_x", 0, "m"
    )


def _events(frames: list[str]) -> list[dict[str, Any]]:
    events = []
    for frame in frames:
        event_line, data_line = frame.rstrip("\n").split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_request_fields_become_chat_fields() -> None:
    body = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 7,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "stream": True,
        }
    )
    chat = chat_request_of(body, [{"role": "user", "content": "hi"}])
    dumped = chat.model_dump(exclude_none=True, by_alias=True)
    assert dumped["max_completion_tokens"] == 7
    assert dumped["tools"][0]["function"]["name"] == "f"
    assert dumped["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert dumped["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert dumped["stream_options"] == {"include_usage": True}
    assert "temperature" not in dumped  # left out, so the chat path's default applies


def test_a_bad_translated_field_is_a_400_naming_the_responses_field() -> None:
    body = ResponsesRequest.model_validate(
        {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}
    )
    with pytest.raises(InvalidRequestError) as caught:
        chat_request_of(body, input_messages(body.input))
    assert caught.value.param == "tools"


def test_function_call_items_join_the_assistant_message_before_them() -> None:
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
            ]
        }
    )
    messages = input_messages(body.input)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] == "Checking."
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sun"}


def test_streamed_tool_call_deltas_become_function_call_events() -> None:
    stream = ResponseEventStream(_shell())
    frames = stream.opening()
    frames += stream.feed(TextDelta(0, ""))
    frames += stream.feed(TextDelta(0, "Let me check."))
    frames += stream.feed(ToolCallStart(0, 0, "call_1", "w"))
    frames += stream.feed(ToolCallArguments(0, 0, '{"a"'))
    frames += stream.feed(ToolCallArguments(0, 0, ": 1}"))
    frames += stream.feed(ToolCallEnd(0, 0))
    frames += stream.feed(ChoiceFinished(0, "tool_calls", tool_calls=True))
    frames += stream.feed(Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=0))
    frames += stream.complete()
    events = _events(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["usage"]["total_tokens"] == 14
    message, function_call = final["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert function_call["call_id"] == "call_1" and function_call["arguments"] == '{"a": 1}'
    assert events[8]["item"]["arguments"] == "" and events[8]["output_index"] == 1
    # The JSON answer to the same reply has the same items.
    reply = Reply(content="Let me check.", tool_calls=[ToolCall("call_1", "w", '{"a": 1}')])
    strip = [{k: v for k, v in item.items() if k != "id"} for item in final["output"]]
    assert strip == [
        {k: v for k, v in item.items() if k != "id"} for item in output_items(reply, "tool_calls")
    ]
    assert assistant_turn(final["output"])["tool_calls"][0]["id"] == "call_1"


def test_an_error_frame_ends_the_stream_with_response_failed() -> None:
    stream = ResponseEventStream(_shell())
    stream.opening()
    stream.feed(TextDelta(0, "partial"))
    error = {"message": "timed out", "type": "timeout_error", "param": None, "code": 408}
    (failed,) = _events(stream.fail(error))
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["status"] == "failed"
    assert response["error"]["code"] == "server_error"
    assert response["error"]["message"] == "timed out"
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "partial"


def test_an_empty_answer_is_still_a_message() -> None:
    stream = ResponseEventStream(_shell())
    stream.feed(ChoiceFinished(0, "stop"))
    events = _events(stream.complete())
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert [i["type"] for i in output_items(Reply(content=""), "stop")] == ["message"]


def test_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # reading "a" keeps it; "b" is now the oldest
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2
    with pytest.raises(ValueError):
        ResponseStore(max_responses=0)
