"""Prompt log-probabilities through the real server on both runners: ``echo`` + ``logprobs``
on completions (OpenAI's legacy shape) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("prompt-logprobs"), "--runner", request.param, "--slots", "2"
    )
    yield proc
    stop_server(proc)


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def test_echo_scores_the_prompt_as_the_model_scores_its_own_tokens(client: openai.OpenAI) -> None:
    first = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0
    )
    assert first.choices[0].logprobs is not None
    generated = first.choices[0].logprobs.token_logprobs or []
    # The prompt plus the token the model chose, scored as a prompt: that last position's
    # logprob is the one the model gave the token when it sampled it.
    both = client.completions.create(
        model=MODEL,
        prompt=PROMPT + first.choices[0].text,
        max_tokens=1,
        temperature=0,
        logprobs=2,
        echo=True,
    )
    choice = both.choices[0]
    assert choice.text.startswith(PROMPT + first.choices[0].text)
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    usage = both.usage
    assert usage is not None
    assert len(lp.tokens) == usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(t is not None and len(t) == 2 for t in lp.top_logprobs[1:])
    scored = lp.token_logprobs[usage.prompt_tokens - 1]
    assert scored is not None and generated[0] is not None
    assert math.isclose(scored, generated[0], abs_tol=0.05)
    assert lp.text_offset == sorted(lp.text_offset)


def test_vllm_prompt_logprobs_on_completions_and_chat(server: ServerProcess) -> None:
    completion = httpx.post(
        f"{server.api_url}/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0},
        timeout=60,
    ).json()
    entries = completion["choices"][0]["prompt_logprobs"]
    assert len(entries) == completion["usage"]["prompt_tokens"] and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2
        assert all(
            v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values()
        )
    chat = httpx.post(
        f"{server.api_url}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
        timeout=60,
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    refused = httpx.post(
        f"{server.api_url}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "prompt_logprobs": 0,
            "stream": True,
        },
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_logprobs_do_not_use_the_prefix_cache(server: ServerProcess) -> None:
    body = {"prompt": PROMPT * 4, "max_tokens": 1, "temperature": 0}
    httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
    scored = httpx.post(
        f"{server.api_url}/completions", json={**body, "prompt_logprobs": 0}, timeout=60
    ).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert None not in scored["choices"][0]["prompt_logprobs"][1:]
