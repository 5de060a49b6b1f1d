"""The server on the PyTorch runner (``--runner torch``), through the real ``openai`` client: the
same API as on llama.cpp, batch-invariant greedy text, streaming, disconnects, and the
refusal of what this runner cannot do (structured output)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.prompts import PROMPTS

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("torch-server"),
        "--runner",
        "torch",
        "--slots",
        "8",
        "--max-model-len",
        "1024",
    )
    yield proc
    stop_server(proc)


def test_models_report_the_torch_runner(torch_server: ServerProcess) -> None:
    (entry,) = httpx.get(f"{torch_server.api_url}/models").json()["data"]
    assert entry["runner"] == "torch" and entry["max_model_len"] == 1024 and entry["id"] == MODEL


def test_greedy_chat_is_identical_alone_and_concurrent(torch_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=torch_server.api_url, api_key="x", max_retries=0)

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        return reply.choices[0].message.content or ""

    alone = [ask(p) for p in PROMPTS]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=torch_server.api_url, api_key="x", max_retries=0)

        async def one(prompt: str) -> str:
            reply = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
            return reply.choices[0].message.content or ""

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    assert asyncio.run(together()) == alone
    assert len(set(alone)) == len(PROMPTS)


def test_streaming_with_usage_and_cached_tokens(torch_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=torch_server.api_url, api_key="x", max_retries=0)
    system = "You are terse. " * 20
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello!"},
    ]
    usages = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        usages.append(usage)
    # The second identical request reused the first one's prompt KV (grain 1: all but one).
    details = usages[1].prompt_tokens_details
    assert details is not None and details.cached_tokens == usages[1].prompt_tokens - 1


def test_a_streaming_disconnect_frees_the_slot(torch_server: ServerProcess) -> None:
    aborted_before = torch_server.slots()["requests_aborted"]
    body = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{torch_server.api_url}/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break

    def all_free() -> bool:
        return all(s["state"] == "free" for s in torch_server.slots()["slots"])

    assert wait_until(all_free)
    # Freed by the abort, not by running its 500 tokens out.
    assert torch_server.slots()["requests_aborted"] == aborted_before + 1
    assert torch_server.slots()["kv_used_tokens"] == 0
