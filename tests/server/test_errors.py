"""Bad input gets an OpenAI-shaped error with the right status, and harms no other request."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

MESSAGES = [{"role": "user", "content": "hello"}]

# A 1×1 PNG: a well-formed image, refused by a model that reads text only.
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"
)

BAD_CHAT_BODIES: list[tuple[str, Any, str | None]] = [
    ("wrong type for temperature", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("messages not a list", {"messages": "hello"}, "messages"),
    ("negative max_tokens", {"messages": MESSAGES, "max_tokens": -5}, "max_tokens"),
    ("zero max_tokens", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("empty messages", {"messages": []}, "messages"),
    ("missing messages", {"max_tokens": 5}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
    ("huge logit_bias", {"messages": MESSAGES, "logit_bias": {"42": 1e9}}, "logit_bias"),
    ("logit_bias key not an id", {"messages": MESSAGES, "logit_bias": {"hi": 1}}, "logit_bias"),
    ("logit_bias outside vocab", {"messages": MESSAGES, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("unknown field", {"messages": MESSAGES, "frobnicate": True}, "frobnicate"),
    ("tools", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
    ("top_logprobs without logprobs", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (
        "top_logprobs too many",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
        "top_logprobs",
    ),
    ("n larger than slots", {"messages": MESSAGES, "n": 12}, "n"),
    ("temperature out of range", {"messages": MESSAGES, "temperature": 5}, "temperature"),
    ("top_p zero", {"messages": MESSAGES, "top_p": 0}, "top_p"),
    ("stream not a bool", {"messages": MESSAGES, "stream": "maybe"}, "stream"),
    (
        "image part without a url",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0.image_url.url",
    ),
    (
        "image to a text-only model",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}
            ]
        },
        "messages",
    ),
    ("max_tokens beyond the context", {"messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
    ("messages too long", {"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
    (
        "json_schema without schema",
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    (
        "stream_options without stream",
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
]

BAD_COMPLETION_BODIES: list[tuple[str, Any, str | None]] = [
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("empty string prompt", {"prompt": ""}, "prompt"),
    ("token id outside vocab", {"prompt": [1, 2, 10**7]}, "prompt"),
    ("suffix", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best_of differs from n", {"prompt": "x", "best_of": 3}, "best_of"),
    ("prompt too long", {"prompt": "word " * 5000}, "prompt"),
    ("logprobs too large", {"prompt": "x", "logprobs": 99}, "logprobs"),
]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    ("case", "body", "param"), BAD_CHAT_BODIES, ids=[c[0] for c in BAD_CHAT_BODIES]
)
def test_bad_chat_request_is_a_400(
    server: ServerProcess, case: str, body: Any, param: str | None
) -> None:
    response = httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=30)
    _assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    ("case", "body", "param"), BAD_COMPLETION_BODIES, ids=[c[0] for c in BAD_COMPLETION_BODIES]
)
def test_bad_completion_request_is_a_400(
    server: ServerProcess, case: str, body: Any, param: str | None
) -> None:
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=30)
    _assert_openai_error(response, 400, param)


def test_invalid_json_is_a_400(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.api_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(response, 400, None)
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_model_is_a_404(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.api_url}/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}
    )
    _assert_openai_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"


def test_unknown_route_is_an_openai_shaped_404(server: ServerProcess) -> None:
    _assert_openai_error(httpx.get(f"{server.api_url}/nothing-here"), 404, None)


def test_responses_carry_a_request_id(server: ServerProcess) -> None:
    response = httpx.get(f"{server.api_url}/models", headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    # Without one (or with one unfit for logs) each response gets a fresh id of its own.
    generated = [httpx.get(f"{server.api_url}/models").headers["x-request-id"] for _ in range(2)]
    unfit = httpx.get(f"{server.api_url}/models", headers={"x-request-id": "bad id\tx"})
    generated.append(unfit.headers["x-request-id"])
    assert len(set(generated)) == 3 and "abc-123" not in generated
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in generated), generated


def test_bad_requests_do_not_disturb_a_running_stream(server: ServerProcess) -> None:
    async def main() -> tuple[str, dict[str, Any], list[bool]]:
        async with httpx.AsyncClient(base_url=server.api_url, timeout=120) as http:
            generating = asyncio.Event()  # the stream has produced its first token
            finished = asyncio.Event()

            async def good() -> tuple[str, dict[str, Any]]:
                text, usage = "", {}
                body = {
                    "messages": MESSAGES,
                    "max_tokens": 48,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    async with http.stream("POST", "/chat/completions", json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for choice in chunk["choices"]:
                                text += choice["delta"].get("content") or ""
                            if text:
                                generating.set()
                finally:
                    generating.set()  # never leave bad() waiting
                    finished.set()
                return text, usage

            async def bad() -> list[bool]:
                """Sends every bad body once the stream runs; notes for each answer whether
                the stream was still running when it came."""
                await generating.wait()
                overlapped = []
                for _, body, _ in BAD_CHAT_BODIES:
                    response = await http.post("/chat/completions", json=body)
                    assert response.status_code == 400
                    overlapped.append(not finished.is_set())
                return overlapped

            task = asyncio.ensure_future(good())
            overlapped = await bad()
            text, usage = await task
            return text, usage, overlapped

    text, usage, overlapped = asyncio.run(main())
    assert overlapped[0], "the bad requests were answered while the stream was running"
    assert text and usage["completion_tokens"] == 48
    assert text == _greedy_chat(server, 48), "the stream's text is what it is alone"


def _greedy_chat(server: ServerProcess, max_tokens: int) -> str:
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def tiny_server(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[ServerProcess]:
    """One slot and a queue of one: the third concurrent request must be refused."""
    proc = start_server(tmp_path_factory.mktemp("tiny"), "--slots", "1", "--max-queue", "1")
    yield proc
    stop_server(proc)


def _long_stream(base: str) -> httpx.Response:
    client = httpx.Client(base_url=base, timeout=60)
    body = {"messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    request = client.build_request("POST", "/chat/completions", json=body)
    return client.send(request, stream=True)


def test_full_queue_is_a_429_with_retry_after(tiny_server: ServerProcess) -> None:
    running = _long_stream(tiny_server.api_url)
    assert running.status_code == 200
    assert wait_until(lambda: tiny_server.slots()["slots"][0]["state"] == "generating")
    queued = _long_stream(tiny_server.api_url)  # waits for the slot
    assert queued.status_code == 200
    assert wait_until(lambda: tiny_server.slots()["num_waiting"] == 1)
    refused = httpx.post(
        f"{tiny_server.api_url}/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}
    )
    _assert_openai_error(refused, 429, None)
    assert int(refused.headers["retry-after"]) >= 1
    running.close()
    queued.close()
    assert wait_until(
        lambda: (
            tiny_server.slots()["slots"][0]["state"] == "free"
            and tiny_server.slots()["num_waiting"] == 0
        )
    )


def test_streaming_disconnect_frees_the_slot(tiny_server: ServerProcess) -> None:
    aborted_before = tiny_server.slots()["requests_aborted"]
    response = _long_stream(tiny_server.api_url)
    lines = response.iter_lines()
    for _ in range(3):  # the role chunk, then generated tokens
        assert next(lines).startswith("data: ")
        assert next(lines) == ""
    assert tiny_server.slots()["slots"][0]["state"] == "generating"
    response.close()
    assert wait_until(lambda: tiny_server.slots()["slots"][0]["state"] == "free")
    stats = tiny_server.slots()
    assert stats["requests_aborted"] == aborted_before + 1
    assert stats["slots"][0]["num_output_tokens"] == 0


def test_non_streaming_disconnect_frees_the_slot(tiny_server: ServerProcess) -> None:
    aborted_before = tiny_server.slots()["requests_aborted"]
    body = json.dumps({"messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True}).encode()
    host, port = tiny_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        # The client leaves once its request is generating (a state, not a guess of time).
        assert wait_until(lambda: tiny_server.slots()["slots"][0]["state"] == "generating")
    assert wait_until(lambda: tiny_server.slots()["requests_aborted"] == aborted_before + 1)
    assert tiny_server.slots()["slots"][0]["state"] == "free"
    ok = httpx.post(
        f"{tiny_server.api_url}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 3},
        timeout=30,
    )
    assert ok.status_code == 200
