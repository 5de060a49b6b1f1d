"""Cases a real model cannot produce on demand, run against the app with the fake runner:
a runner failure (500 naming the request id) and a model without a chat template."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.config import EngineConfig
from slotserve.engine.engine_core import EngineCore
from slotserve.server.app import create_app
from slotserve.server.serving import ServingContext
from tests.fake_runner import FakeRunner


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner(num_slots=2)


@pytest.fixture
def http(runner: FakeRunner) -> Iterator[TestClient]:
    ctx = ServingContext(
        engine=AsyncEngine(EngineCore(runner, EngineConfig(num_slots=2))),
        tokenizer=runner.tokenizer,
        model_info=runner.model_info,
        model_name="fake",
        chat_template=None,
    )
    with TestClient(create_app(ctx), raise_server_exceptions=False) as client:
        yield client


def test_runner_failure_is_a_500_naming_the_request_id(
    http: TestClient, runner: FakeRunner
) -> None:
    runner.fail_on_execute = True
    response = http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3},
        headers={"x-request-id": "req-42"},
    )
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and "req-42" in error["message"]
    runner.fail_on_execute = False
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "cde"


def test_runner_failure_mid_stream_ends_the_stream_with_an_error_event(
    http: TestClient, runner: FakeRunner
) -> None:
    runner.fail_on_execute = True
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert '"error"' in lines[0] and lines[-1] == "data: [DONE]"


def test_model_without_chat_template_refuses_chat_naming_the_flag(http: TestClient) -> None:
    response = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400
    assert "--chat-template" in response.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
