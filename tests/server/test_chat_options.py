"""vLLM's chat-template controls and the reasoning parser through the real server:
``continue_final_message`` / ``add_generation_prompt``, ``chat_template_kwargs``,
``--reasoning-parser qwen3`` (whole and streamed), ``max_completion_tokens``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# A ChatML template with one variable of its own, to see chat_template_kwargs arrive.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if brief %}Briefly: {% endif %}{% endif %}"
)
# The 135M model never thinks by itself: a constraint makes it write a <think> block.
THINKING = r"<think>\n[a-z ]{3,30}\n</think>\n\n(Hello|Hi) there\."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("chat-options")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    proc = start_server(
        tmp, "--slots", "2", "--chat-template", str(template), "--reasoning-parser", "qwen3"
    )
    yield proc
    stop_server(proc)


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def _post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.api_url}/chat/completions",
        json={"model": MODEL, "temperature": 0, "max_tokens": 8, **body},
        timeout=60,
    )


def test_continue_final_message_extends_the_assistant_text(server: ServerProcess) -> None:
    user = {"role": "user", "content": "What is the capital of France?"}
    partial = "The capital of France is"
    fresh = _post(server, {"messages": [user]}).json()
    continued = _post(
        server,
        {
            "messages": [user, {"role": "assistant", "content": partial}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    # The same prompt but for the partial answer, which is not closed by <|im_end|>.
    words = httpx.post(
        f"{server.api_url}/completions", json={"prompt": partial, "max_tokens": 1}, timeout=60
    ).json()
    grown = continued["usage"]["prompt_tokens"] - fresh["usage"]["prompt_tokens"]
    assert grown == words["usage"]["prompt_tokens"]
    assert not continued["choices"][0]["message"]["content"].startswith(partial)


@pytest.mark.parametrize(
    "body",
    [
        {"continue_final_message": True},  # add_generation_prompt defaults to true
        {
            "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ],
)
def test_continue_final_message_misuse_is_a_400(
    server: ServerProcess, body: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    response = _post(server, {"messages": messages, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = _post(server, {"messages": messages}).json()
    brief = _post(server, {"messages": messages, "chat_template_kwargs": {"brief": True}}).json()
    assert brief["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_max_completion_tokens_limits_the_reply(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert result.usage is not None and result.usage.completion_tokens == 3
    assert result.choices[0].finish_reason == "length"


def test_reasoning_goes_to_reasoning_content(server: ServerProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 60,
        "regex": THINKING,
    }
    message = _post(server, body).json()["choices"][0]["message"]
    assert message["content"] in ("Hello there.", "Hi there.")
    reasoning = message["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "\n" not in reasoning
    with httpx.stream(
        "POST",
        f"{server.api_url}/chat/completions",
        json={"model": MODEL, "temperature": 0, **body, "stream": True},
        timeout=60,
    ) as response:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_one_model_can_be_retrieved_by_id(client: openai.OpenAI, server: ServerProcess) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    extra = card.model_extra or {}
    assert extra["max_model_len"] > 0 and extra["root"] == MODEL and extra["state"] == "ready"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    slashed = httpx.get(f"{server.api_url}/models/org/name", timeout=10)
    assert slashed.status_code == 404
    assert slashed.json()["error"]["code"] == "model_not_found"
