"""Black-box tests of the OpenAI API against a spawned server, with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ServerProcess
from tests.prompts import PROMPTS

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a short story about a dragon."}
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    """A fresh async client per test: its connection pool belongs to one event loop."""
    return openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_models_and_health(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_eight_concurrent_streaming_chats_finish_with_correct_usage(
    aclient: openai.AsyncOpenAI, client: openai.OpenAI
) -> None:
    max_tokens = 24
    reference = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=CHAT, max_tokens=1, temperature=0
    )
    assert reference.usage is not None
    prompt_tokens = reference.usage.prompt_tokens

    async def one(i: int) -> tuple[str, openai.types.CompletionUsage | None, str | None]:
        stream = await aclient.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=CHAT,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, usage, finish

    async def main() -> list[tuple[str, openai.types.CompletionUsage | None, str | None]]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    for text, usage, finish in results:
        assert text
        assert finish == "length"
        assert usage is not None
        assert usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens == max_tokens
        assert usage.total_tokens == prompt_tokens + max_tokens


def _greedy_completion(client: openai.OpenAI, prompt: str, max_tokens: int = 32) -> str:
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].text


def test_greedy_text_is_identical_alone_and_concurrent(
    client: openai.OpenAI, aclient: openai.AsyncOpenAI
) -> None:
    alone = [_greedy_completion(client, p) for p in PROMPTS]

    async def together() -> list[str]:
        results = await asyncio.gather(
            *(
                aclient.completions.create(
                    model="SmolLM2-135M-Instruct.Q4_1",
                    prompt=p,
                    max_tokens=32,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in PROMPTS
            )
        )
        return [r.choices[0].text for r in results]

    assert asyncio.run(together()) == alone
    assert len(set(alone)) == len(PROMPTS)


def test_seeded_request_gives_the_same_text_alone_and_in_a_batch(
    client: openai.OpenAI, aclient: openai.AsyncOpenAI
) -> None:
    def seeded() -> dict[str, object]:
        return {
            "model": "SmolLM2-135M-Instruct.Q4_1",
            "messages": CHAT,
            "max_tokens": 32,
            "temperature": 1.0,
            "seed": 42,
        }

    alone = client.chat.completions.create(**seeded()).choices[0].message.content  # type: ignore[call-overload]

    async def batched() -> str | None:
        noise = [
            aclient.chat.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1",
                messages=[{"role": "user", "content": p}],
                max_tokens=32,
                temperature=1.0,
            )
            for p in PROMPTS[:6]
        ]
        results = await asyncio.gather(aclient.chat.completions.create(**seeded()), *noise)  # type: ignore[call-overload]
        return results[0].choices[0].message.content  # type: ignore[no-any-return]

    assert asyncio.run(batched()) == alone


def test_stop_string_is_cut_streamed_and_not_streamed(client: openai.OpenAI) -> None:
    full = _greedy_completion(client, PROMPTS[4])
    words = full.split()
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    cut = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt=PROMPTS[4],
        max_tokens=32,
        temperature=0,
        stop=[stop],
    )
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            prompt=PROMPTS[4],
            max_tokens=32,
            temperature=0,
            stop=[stop],
            stream=True,
        )
        if c.choices
    ]
    assert "".join(pieces) == expected


def test_n_choices_and_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=CHAT,
        max_tokens=8,
        temperature=1.0,
        n=3,
        logprobs=True,
        top_logprobs=3,
        seed=7,
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens <= 24
    for choice in result.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0.0
            assert len(entry.top_logprobs) == 3
            best = [t.logprob for t in entry.top_logprobs]
            assert best == sorted(best, reverse=True)


def test_completion_logprobs_shape_and_echo(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=2,
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.top_logprobs is not None and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])
    echoed = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        echo=True,
    )
    assert echoed.choices[0].text == "The capital of France is" + result.choices[0].text


def test_several_prompts_in_one_completion_request(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt=PROMPTS[:3],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [
        _greedy_completion(client, p, max_tokens=6) for p in PROMPTS[:3]
    ]
    assert result.usage is not None and result.usage.completion_tokens == 18


def test_token_id_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt=[504, 3575, 282],
        max_tokens=4,
        temperature=0,
    )
    assert result.usage is not None and result.usage.prompt_tokens == 3


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    data = json.loads(result.choices[0].message.content or "")
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_json_object_response_format_starts_an_object(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "Reply in JSON."}],
        max_tokens=16,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert (result.choices[0].message.content or "").lstrip().startswith("{")


def test_sampling_extensions_are_accepted(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=CHAT,
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"330": -100},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert result.choices[0].finish_reason in ("stop", "length")
