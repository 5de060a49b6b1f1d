"""Agent frameworks against a spawned server: an ``openai-agents`` Agent forced to call its
function tool over the Responses API, and LangChain's ``with_structured_output`` both ways
(a JSON schema, a forced function call)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, SecretStr

from tests.conftest import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("agents"), "--slots", "2")
    yield proc
    stop_server(proc)


@pytest.mark.parametrize("tool_choice", ["get_weather", "required"])
def test_an_agent_calls_its_function_tool(server: ServerProcess, tool_choice: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace upload to OpenAI
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 24 C"

    client = openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # One call, then a short answer: a 135M model given free rein repeats itself.
        model_settings=ModelSettings(
            tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48, temperature=0
        ),
        # The tool's result is the answer: a forced choice would force the next turn again.
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(calls) >= 1 and all(isinstance(city, str) for city in calls)
    assert result.final_output == "Sunny, 24 C"
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds


class Capital(BaseModel):
    country: str
    city: str


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_parsed(server: ServerProcess, method: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.api_url,
        api_key=SecretStr("unused"),
        temperature=0,
        max_completion_tokens=64,
    )
    structured = llm.with_structured_output(Capital, method=method)  # type: ignore[arg-type]
    answer = structured.invoke("France's capital is Paris. Give the country and its capital.")
    assert isinstance(answer, Capital)
    assert answer.country and answer.city
