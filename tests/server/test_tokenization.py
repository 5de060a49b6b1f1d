"""``POST /tokenize`` and ``POST /detokenize`` against a real server: vLLM's shapes, the chat
form rendered exactly as a chat completion's prompt, round trips, and the errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from slotserve.server.access import AccessPolicy
from slotserve.server.access_middleware import AccessMiddleware
from tests.conftest import ServerProcess

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def test_a_prompt_is_tokenized_with_its_count_and_context(server: ServerProcess) -> None:
    reply = post(server, "/tokenize", {"prompt": "Hello, world!", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 1
    assert (
        body["max_model_len"]
        == httpx.get(f"{server.api_url}/models").json()["data"][0]["max_model_len"]
    )
    assert "".join(body["token_strs"]) == "Hello, world!"


def test_token_strs_are_null_unless_asked(server: ServerProcess) -> None:
    assert post(server, "/tokenize", {"prompt": "Hi"}).json()["token_strs"] is None


def test_special_token_markup_becomes_one_token(server: ServerProcess) -> None:
    plain = post(server, "/tokenize", {"prompt": "<|im_start|>"}).json()
    assert plain["count"] == 1


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  spaces\tand\nlines  ", "héllo → ünïcode ✓ 日本語"]
)
def test_detokenize_undoes_tokenize(server: ServerProcess, text: str) -> None:
    tokens = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()[
        "tokens"
    ]
    reply = post(server, "/detokenize", {"tokens": tokens})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": text}


def test_chat_count_is_the_chat_completions_prompt_tokens(server: ServerProcess) -> None:
    tokenized = post(server, "/tokenize", {"messages": MESSAGES}).json()
    completion = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0},
        timeout=60,
    ).json()
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["count"] == completion["usage"]["prompt_tokens"]


def test_chat_prompt_round_trips_through_the_template_markup(server: ServerProcess) -> None:
    tokens = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert "<|im_start|>user\nName a colour.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    again = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert again["tokens"] == tokens


def test_chat_template_controls(server: ServerProcess) -> None:
    with_prompt = post(server, "/tokenize", {"messages": MESSAGES}).json()
    without = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without.json()["count"] < with_prompt["count"]
    continued = post(
        server,
        "/tokenize",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Blue"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    text = post(server, "/detokenize", {"tokens": continued["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nBlue")


def test_tools_are_rendered_into_the_prompt(server: ServerProcess) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    plain = post(server, "/tokenize", {"messages": MESSAGES}).json()
    with_tools = post(server, "/tokenize", {"messages": MESSAGES, "tools": [tool]}).json()
    assert with_tools["count"] > plain["count"]


def test_add_special_tokens_is_honoured(server: ServerProcess) -> None:
    # The embedded model's vocabulary adds no BOS token, so the switch changes nothing here;
    # what matters is that both values are taken.
    on = post(server, "/tokenize", {"prompt": "Hi", "add_special_tokens": True})
    off = post(server, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    assert on.status_code == off.status_code == 200
    assert on.json()["count"] >= off.json()["count"]
    chat_off = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": False})
    assert chat_off.status_code == 200


def error_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_out_of_range_token_ids_are_refused(server: ServerProcess) -> None:
    vocab = post(server, "/detokenize", {"tokens": [10**9]})
    assert error_of(vocab)["param"] == "tokens"
    assert error_of(post(server, "/detokenize", {"tokens": [1, -1]}))["param"] == "tokens"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "a", "messages": MESSAGES},
        {"prompt": 3},
        {"prompt": "a", "unknown": True},
        {"messages": []},
        {"messages": MESSAGES, "continue_final_message": True},
    ],
)
def test_bad_tokenize_requests_are_400(server: ServerProcess, body: dict[str, Any]) -> None:
    error_of(post(server, "/tokenize", body))


def test_an_unknown_model_is_404(server: ServerProcess) -> None:
    reply = post(server, "/tokenize", {"model": "no-such-model", "prompt": "a"})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"]
    assert post(server, "/detokenize", {"model": "no-such", "tokens": [1]}).status_code == 404


def test_the_routes_are_in_the_openapi_schema(server: ServerProcess) -> None:
    paths = httpx.get(f"{server.base_url}/openapi.json").json()["paths"]
    assert "post" in paths["/tokenize"] and "post" in paths["/detokenize"]


def test_the_api_key_guards_tokenization_as_it_guards_v1() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("reached the app without the key")

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request"}

    guard = AccessMiddleware(app, AccessPolicy(api_key="secret"))
    for path in ("/tokenize", "/detokenize"):
        sent.clear()
        asyncio.run(guard({"type": "http", "path": path, "headers": []}, receive, send))
        assert sent[0]["status"] == 401
