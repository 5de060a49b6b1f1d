"""Cases a real model cannot produce on demand, run against the app with the fake runner: a
runner failure (the model turns unhealthy until reloaded), a model without a chat template,
and a model that fails to load."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from slotserve.engine.config import EngineConfig
from slotserve.engine.runner_interface import Runner
from slotserve.hosting.registry import ModelRegistry
from slotserve.hosting.served import ModelLaunch, RestartPolicy
from slotserve.server.app import create_app
from slotserve.server.metrics import ServerMetrics
from slotserve.server.serving import ServingContext
from tests.conftest import local_client, wait_until
from tests.fake_runner import FakeRunner


def make_client(build_runner: object) -> TestClient:
    metrics = ServerMetrics()
    models = ModelRegistry(on_outputs=metrics.observe)
    # Restarts off: these tests show the unhealthy state and the reload that ends it.
    launch = ModelLaunch(
        "fake",
        build_runner,  # type: ignore[arg-type]
        EngineConfig(num_slots=2),
        restart=RestartPolicy(enabled=False),
    )
    models.add(launch)
    return local_client(create_app(ServingContext(models, metrics)))


def ready(http: TestClient) -> bool:
    return http.get("/ready").status_code == 200


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner(num_slots=2)


@pytest.fixture
def http(runner: FakeRunner) -> Iterator[TestClient]:
    with make_client(lambda: runner) as client:
        assert wait_until(lambda: ready(client), timeout=10)
        yield client


def test_runner_failure_makes_the_model_unhealthy_until_reloaded(
    http: TestClient, runner: FakeRunner
) -> None:
    runner.fail_on_execute = True
    response = http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3},
        headers={"x-request-id": "req-42"},
    )
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "model_unhealthy"
    assert "/admin/reload" in error["message"] and "simulated device failure" in error["message"]
    assert response.headers["x-request-id"] == "req-42"
    # Health, readiness and the model list all say so; new requests get a 503 at once.
    assert http.get("/health").status_code == 503
    assert http.get("/health").json()["status"] == "unhealthy"
    assert http.get("/ready").status_code == 503
    (entry,) = http.get("/v1/models").json()["data"]
    assert entry["state"] == "unhealthy" and "runner failure" in entry["reason"]
    refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert refused.status_code == 503 and "/admin/reload" in refused.json()["error"]["message"]
    # Recovery.
    runner.fail_on_execute = False
    reloaded = http.post("/admin/reload")
    assert reloaded.status_code == 200
    assert reloaded.json() == {"status": "ready", "model": "fake", "loads": 2}
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "cde"
    metrics = http.get("/metrics").text
    assert 'slotserve:model_loads_total{model_name="fake"} 2.0' in metrics
    assert 'vllm:request_success_total{finished_reason="error",model_name="fake"} 1.0' in metrics


def test_runner_failure_mid_stream_ends_the_stream_with_an_error_event(
    http: TestClient, runner: FakeRunner
) -> None:
    runner.fail_on_execute = True
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert '"error"' in lines[0] and '"code":503' in lines[0]
    assert lines[-1] == "data: [DONE]"


def test_model_without_chat_template_refuses_chat_naming_the_flag(http: TestClient) -> None:
    response = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400
    assert "--chat-template" in response.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_model_that_fails_to_load_is_reported_and_can_be_retried() -> None:
    attempts: list[int] = []

    def build() -> Runner:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("weights file is truncated")
        return FakeRunner(num_slots=2)

    with make_client(build) as http:
        assert wait_until(lambda: http.get("/health").status_code == 503, timeout=10)
        body = http.get("/health").json()
        assert body["status"] == "failed" and "weights file is truncated" in body["reason"]
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "failed to load" in refused.json()["error"]["message"]
        assert http.post("/admin/reload").status_code == 200
        assert (
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        )


def test_a_request_level_runner_failure_is_a_500_naming_the_request_id(
    http: TestClient, runner: FakeRunner
) -> None:
    runner.fail_add_sequence = True
    response = http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers={"x-request-id": "r-9"}
    )
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and "r-9" in error["message"]
    runner.fail_add_sequence = False
    assert http.get("/ready").status_code == 200, "one request's failure leaves the model healthy"
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_while_loading_readiness_fails_and_generation_is_a_503_with_retry_after() -> None:
    release = threading.Event()

    def slow_build() -> Runner:
        assert release.wait(timeout=30)
        return FakeRunner(num_slots=2)

    with make_client(slow_build) as http:
        assert http.get("/health").json() == {"status": "loading", "reason": "the model is loading"}
        assert http.get("/health").status_code == 200, "alive while loading"
        assert http.get("/ready").status_code == 503
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "model_unavailable"
        assert http.post("/admin/reload").status_code == 409, "a load is already running"
        assert http.get("/v1/models").json()["data"][0]["state"] == "loading"
        release.set()
        assert wait_until(lambda: ready(http), timeout=10)
        assert (
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        )
