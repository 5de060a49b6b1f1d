"""Structured output on both runners through the real server (SPEC E5): JSON schema, regex,
choice and grammars hold on the embedded 135M model, bad constraints get a 400 naming the
field, and an unconstrained request beside a constrained one is unchanged."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK_PERSON: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Describe a person as JSON."}
]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("structured"),
        "--runner",
        request.param,
        "--slots",
        "4",
        "--max-model-len",
        "1024",
    )
    yield proc
    stop_server(proc)


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> str:
    messages: list[ChatCompletionMessageParam] = kwargs.pop("messages", ASK_PERSON)
    result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return result.choices[0].message.content or ""


def test_strict_json_schema_is_followed(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}
    fmt["json_schema"]["strict"] = True
    result = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=120, response_format=fmt
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"  # the grammar ended the reply, not the length
    data = json.loads(choice.message.content or "")
    assert set(data) == {"name", "age", "role"}
    assert isinstance(data["name"], str) and len(data["name"]) <= 20
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 130
    assert data["role"] in ("admin", "user")


def test_json_object_gives_an_object(client: openai.OpenAI) -> None:
    # The 135M model nests objects without end under a bare json_object: cut it short and
    # check what it wrote is an object so far (a stop would have to parse whole).
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object with keys a and b."}],
        temperature=0,
        max_tokens=12,
        response_format={"type": "json_object"},
    )
    choice = result.choices[0]
    text = choice.message.content or ""
    assert text.lstrip().startswith("{") and '"' in text
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammars(client: openai.OpenAI) -> None:
    date = r"\d{4}-\d{2}-\d{2}"
    text = _chat(client, max_tokens=20, extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, text)
    text = _chat(client, max_tokens=20, extra_body={"regex": "(yes|no)!"})  # SGLang's field
    assert text in ("yes!", "no!")
    colours = ["red", "green", "dark blue"]
    text = _chat(client, max_tokens=20, extra_body={"structured_outputs": {"choice": colours}})
    assert text in colours
    gbnf = 'root ::= "Answer: " [0-9]+ "."'
    text = _chat(client, max_tokens=20, extra_body={"ebnf": gbnf})
    assert re.fullmatch(r"Answer: \d+\.", text)
    lark = 'start: "x=" NUMBER\nNUMBER: /[0-9]{1,3}/'
    text = _chat(client, max_tokens=20, extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"x=\d{1,3}", text)


def test_completions_take_constraints_too(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt="The colour of the sky is",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [" blue", " grey"]}},
    )
    assert result.choices[0].text in (" blue", " grey")


def test_a_constraint_cut_by_max_tokens_says_length(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        temperature=0,
        max_tokens=3,
        response_format={"type": "json_object"},
    )
    assert result.choices[0].finish_reason == "length"
    assert (result.choices[0].message.content or "").startswith("{")


def test_streamed_constrained_output_equals_the_whole(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}
    whole = _chat(client, max_tokens=120, response_format=fmt)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        temperature=0,
        max_tokens=120,
        response_format=fmt,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole


@pytest.mark.parametrize(
    ("extra", "param", "phrase"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"regex": "[z-a]"}, "regex", "regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "json_schema",
        ),
        ({"ebnf": 'root ::= "a" undefined_rule'}, "ebnf", "undefined_rule"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
        ({"structured_outputs": {}}, "structured_outputs", "no constraint"),
        (
            {"regex": "a", "structured_outputs": {"choice": ["b"]}},
            "regex",
            "one output constraint",
        ),
    ],
)
def test_bad_constraints_get_a_400_naming_the_field(
    server: ServerProcess, extra: dict[str, Any], param: str, phrase: str
) -> None:
    response = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"messages": ASK_PERSON, "max_tokens": 5, **extra},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert phrase in error["message"]


def test_an_unconstrained_neighbour_is_unchanged(server: ServerProcess) -> None:
    """Masks touch only the constrained rows: greedy text of a plain request is the same alone
    and while constrained requests run beside it in the same steps."""
    plain = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    constrained = {**plain, "messages": ASK_PERSON, "response_format": {"type": "json_object"}}

    async def run(bodies: list[dict[str, Any]]) -> list[str]:
        async with httpx.AsyncClient(base_url=server.api_url, timeout=120) as http:
            replies = await asyncio.gather(
                *(http.post("/chat/completions", json=b) for b in bodies)
            )
        return [r.json()["choices"][0]["message"]["content"] for r in replies]

    alone = asyncio.run(run([plain]))[0]
    together = asyncio.run(run([constrained, plain, constrained]))
    assert together[1] == alone
    assert together[0].startswith("{") and together[2] == together[0]
