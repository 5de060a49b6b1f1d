"""The Responses API's pieces without a server: the request → chat translation (namespace,
custom and hosted tools, history items), the stream rendering of the pipeline's events checked
against the ``openai`` SDK's types, the reasoning encoding, and the bounded store."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseReasoningItem,
    ResponseStreamEvent,
)
from pydantic import TypeAdapter, ValidationError

from slotserve.engine.errors import InvalidRequestError
from slotserve.protocol.tool_parsers import ToolCall
from slotserve.server.events import (
    ChoiceFinished,
    ReasoningDelta,
    Reply,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from slotserve.server.responses.chat_request import chat_request_of, input_messages
from slotserve.server.responses.output import (
    OutputOptions,
    assistant_turn,
    decode_reasoning,
    encode_reasoning,
    output_items,
    response_shell,
)
from slotserve.server.responses.protocol import ResponsesRequest
from slotserve.server.responses.store import ResponseStore, StoredResponse
from slotserve.server.responses.stream import ResponseEventStream
from slotserve.server.responses.tools import ToolRef, chat_tools

_SDK_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


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


# A request shaped like Codex CLI's: a namespace of functions, a hosted tool, a free-form tool.
CODEX_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
    {
        "type": "namespace",
        "name": "agents",
        "description": "Tools for sub-agents.",
        "tools": [
            {"type": "function", "name": "spawn", "description": "Start one.", "strict": False},
        ],
    },
    {"type": "web_search", "external_web_access": False},
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    },
]


def _codex_body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", "tools": CODEX_TOOLS, **fields})


def test_namespace_and_custom_tools_are_flattened_and_hosted_ones_left_out() -> None:
    body = _codex_body(tool_choice="auto")
    tools, names = chat_tools(body)
    functions = {t["function"]["name"]: t["function"] for t in tools}
    assert list(functions) == ["exec_command", "agents__spawn", "apply_patch"]
    assert functions["agents__spawn"]["description"] == "Tools for sub-agents.\nStart one."
    assert functions["apply_patch"]["parameters"]["required"] == ["input"]
    assert (
        "start: /.+/"
        in functions["apply_patch"]["parameters"]["properties"]["input"]["description"]
    )
    assert names.ref("agents__spawn") == ToolRef("function", "spawn", "agents")
    chat = chat_request_of(body, [{"role": "user", "content": "hi"}])
    assert len(chat.tools or []) == 3 and chat.tool_choice == "auto"


def test_only_hosted_tools_offer_nothing_and_cannot_be_forced() -> None:
    hosted = ResponsesRequest.model_validate(
        {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "auto"}
    )
    chat = chat_request_of(hosted, [{"role": "user", "content": "hi"}])
    assert chat.tools is None and chat.tool_choice is None
    forced = hosted.model_copy(update={"tool_choice": "required"})
    with pytest.raises(InvalidRequestError) as caught:
        chat_request_of(forced, [{"role": "user", "content": "hi"}])
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("kind", ["teleport", {}, ["function"], None, 7])
def test_an_unknown_tool_type_is_refused_naming_the_types(kind: object) -> None:
    # An unhashable type (an object, a list) was a TypeError, a 500, before (schemathesis).
    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate({"input": "hi", "tools": [{"type": kind}]})
    assert "namespace" in str(caught.value) and "web_search" in str(caught.value)


def test_calls_map_back_to_namespaced_and_custom_items() -> None:
    _, names = chat_tools(_codex_body())
    reply = Reply(
        tool_calls=[
            ToolCall("c1", "agents__spawn", '{"task": "x"}'),
            ToolCall("c2", "apply_patch", '{"input": "*** Begin Patch"}'),
        ]
    )
    spawn, patch = output_items(reply, "tool_calls", OutputOptions(names=names))
    assert spawn["type"] == "function_call" and spawn["name"] == "spawn"
    assert spawn["namespace"] == "agents"
    assert patch["type"] == "custom_tool_call" and patch["input"] == "*** Begin Patch"
    ResponseFunctionToolCall.model_validate(spawn)
    ResponseCustomToolCall.model_validate(patch)
    # Replayed (previous_response_id), they are named as the model was offered them.
    turn = assistant_turn([spawn, patch])
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["agents__spawn", "apply_patch"]
    assert json.loads(turn["tool_calls"][1]["function"]["arguments"]) == {
        "input": "*** Begin Patch"
    }


def test_history_items_become_chat_messages() -> None:
    secret = encode_reasoning("I should list files.")
    developer = [{"type": "input_text", "text": "Be careful."}]
    custom_output = [{"type": "input_text", "text": "done"}]
    spawn = {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents"}
    body = _codex_body(
        input=[
            {"type": "message", "role": "developer", "content": developer},
            {"role": "user", "content": "list files"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": secret},
            spawn | {"arguments": "{}"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "p"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": custom_output},
            {"type": "function_call_output", "name": "goal", "namespace": "agent", "output": "x"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Answer."}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        ]
    )
    messages = input_messages(body.input)
    assert [m["role"] for m in messages] == [
        "developer",
        "user",
        "assistant",
        "tool",
        "tool",
        "tool",
        "assistant",
    ]
    calls = messages[2]["tool_calls"]
    assert messages[2]["reasoning_content"] == "I should list files."
    assert [c["function"]["name"] for c in calls] == ["agents__spawn", "apply_patch"]
    assert calls[1]["function"]["arguments"] == '{"input": "p"}'
    assert messages[4]["content"] == "done"
    assert messages[5]["tool_call_id"] == "agent__goal"
    assert messages[6] == {"role": "assistant", "content": "No.", "reasoning_content": "Answer."}
    # The chat request takes them (developer is the system role to the template).
    chat_request_of(body, messages)


def test_encrypted_reasoning_round_trips_and_foreign_content_is_dropped() -> None:
    assert decode_reasoning(encode_reasoning("thinking ✓")) == "thinking ✓"
    assert decode_reasoning("gAAAAABo-openai-encrypted") is None
    assert decode_reasoning("slotserve.reasoning.v1:!!!") is None


def test_codex_fields_are_accepted_and_echoed() -> None:
    body = _codex_body(
        stream=True,
        store=False,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        prompt_cache_key="thread-1",
        client_metadata={"session_id": "s"},
        safety_identifier="user-hash",
        service_tier="auto",
        truncation="auto",
        text={"verbosity": "low"},
        max_tool_calls=3,
        parallel_tool_calls=True,
        tool_choice="auto",
    )
    shell = response_shell(body, "resp_x", 0, "m")
    shell["status"] = "completed"
    response = Response.model_validate(shell)
    assert response.prompt_cache_key == "thread-1"
    assert [t.type for t in response.tools] == ["function", "namespace", "web_search", "custom"]
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "hi", "background": True})
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "hi", "include": ["everything"]})


def test_streamed_reasoning_and_custom_calls_validate_as_sdk_events() -> None:
    _, names = chat_tools(_codex_body())
    stream = ResponseEventStream(_shell(), OutputOptions(names=names, encrypted_reasoning=True))
    frames = stream.opening()
    frames += stream.feed(ReasoningDelta(0, "Patch it."))
    frames += stream.feed(ToolCallStart(0, 0, "call_1", "apply_patch"))
    frames += stream.feed(ToolCallArguments(0, 0, '{"input": "line\\n'))
    frames += stream.feed(ToolCallArguments(0, 0, 'two"}'))
    frames += stream.feed(ToolCallEnd(0, 0))
    frames += stream.feed(ToolCallStart(0, 1, "call_2", "agents__spawn"))
    frames += stream.feed(ToolCallArguments(0, 1, "{}"))
    frames += stream.feed(ChoiceFinished(0, "tool_calls", tool_calls=True))
    frames += stream.feed(Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=3))
    frames += stream.complete()
    events = [_SDK_EVENT.validate_python(e) for e in _events(frames)]
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    completed = events[-1]
    assert isinstance(completed, ResponseCompletedEvent)
    final = completed.response
    reasoning, patch, spawn = final.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.encrypted_content
    assert decode_reasoning(reasoning.encrypted_content) == "Patch it."
    assert isinstance(patch, ResponseCustomToolCall) and patch.input == "line\ntwo"
    assert isinstance(spawn, ResponseFunctionToolCall) and spawn.namespace == "agents"
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 3
