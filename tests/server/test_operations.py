"""Operating the server (SPEC S2-S7, E2, E10): metrics, slots, health and readiness, limits,
the API key, request ids in logs, timeouts and graceful shutdown, against spawned servers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

pytestmark = pytest.mark.slow  # its tests start servers of their own

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, keyed by name and sorted labels."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return float(samples.get(key, 0.0))


def test_metrics_use_vllm_names_and_move_with_traffic(server: ServerProcess) -> None:
    before = scrape(server)
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    reply = client.completions.create(
        model=MODEL, prompt="One two three", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None
    httpx.post(f"{server.api_url}/completions", json={"prompt": "x", "max_tokens": -1})
    assert wait_until(lambda: server.slots()["num_running"] == 0)
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert grew(f"{histogram}_count") == 1, histogram
    assert grew("vllm:inter_token_latency_seconds_count") == 4  # five tokens, four gaps
    assert grew("slotserve:http_errors_total", status="400", type="invalid_request_error") == 1
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0, "idle: no running request holds KV"
    assert value(after, "slotserve:kv_cache_capacity_tokens") > 0
    assert value(after, "slotserve:slots", state="free") == 8
    assert value(after, "slotserve:model_state", state="ready") == 1
    assert ("vllm:prefix_cache_queries_total", (("model_name", MODEL),)) in after


def test_slots_health_and_readiness(server: ServerProcess) -> None:
    slots = server.slots()
    assert slots["state"] == "ready" and len(slots["slots"]) == 8
    assert set(slots["slots"][0]) >= {"index", "state", "request_id", "num_computed_tokens"}
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready").json() == {"status": "ready"}
    (entry,) = httpx.get(f"{server.api_url}/models").json()["data"]
    # --runner auto: the embedded GGUF on the PyTorch runner, its weights kept as stored.
    assert entry["state"] == "ready" and entry["runner"] == "torch" and entry["slots"] == 8
    # Which kernels serve, with which CPU features.
    compute = entry["compute"]
    assert compute["device"] == "cpu" and compute["batch_invariant"] is True
    assert compute["kernels"].startswith("slotserve CPU kernels (")
    assert "weights kept quantized (Q4_1" in compute["kernels"]
    assert compute["cpu_features"] and all(f.isupper() for f in compute["cpu_features"])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_prompt_plus_max_tokens_over_the_context_names_the_numbers(
    server: ServerProcess, route: str
) -> None:
    limit = httpx.get(f"{server.api_url}/models").json()["data"][0]["max_model_len"]
    body: dict[str, object] = {"max_tokens": limit}
    if route == "completions":
        body["prompt"] = "Hello there"
    else:
        body["messages"] = [{"role": "user", "content": "Hello there"}]
    response = httpx.post(f"{server.api_url}/{route}", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    match = re.search(
        r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
        r"\((\d+) in the prompt, (\d+) for the completion\)",
        error["message"],
    )
    assert match is not None, error["message"]
    context, requested, prompt, completion = map(int, match.groups())
    assert context == limit and completion == limit and requested == prompt + completion


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("keyed"),
        "--slots",
        "2",
        env={"SLOTSERVE_API_KEY": "sk-test-secret-4242", "SLOTSERVE_LOG_LEVEL": "debug"},
    )
    yield proc
    stop_server(proc)


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://127.0.0.1:9999"},  # a page on another local port
        {"Host": "rebound.example:8000"},  # a name rebound to loopback
        {"X-Forwarded-For": "203.0.113.9"},  # a proxy on this machine relaying a caller
    ],
    ids=["origin", "host", "forwarded"],
)
def test_without_a_key_only_local_callers_reach_the_admin_routes(
    server: ServerProcess, headers: dict[str, str]
) -> None:
    refused = httpx.post(f"{server.base_url}/flush_cache", headers=headers)
    assert refused.status_code == 403, refused.text
    assert httpx.post(f"{server.base_url}/flush_cache").status_code == 200


def test_api_key_is_required_on_the_api_but_not_on_probes(keyed_server: ServerProcess) -> None:
    url = keyed_server.api_url
    missing = httpx.post(f"{url}/completions", json={"prompt": "hi", "max_tokens": 2})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    assert missing.headers["x-request-id"]
    wrong = httpx.get(f"{url}/models", headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert "sk-wrong" not in wrong.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key="sk-test-secret-4242", max_retries=0)
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
    admin = httpx.post(f"{keyed_server.base_url}/admin/reload")
    assert admin.status_code == 401, "admin routes need the key too"
    assert httpx.post(f"{keyed_server.base_url}/flush_cache").status_code == 401
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(keyed_server.base_url + open_path).status_code == 200, open_path
    assert (
        'slotserve:http_errors_total{model_name="'
        in httpx.get(keyed_server.base_url + "/metrics").text
    )
    log = keyed_server.log_path.read_text()
    assert "sk-test-secret-4242" not in log, "the key never reaches the log"
    assert (
        "admin routes (/admin/reload, /models/load, /models/unload, /flush_cache, "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter): callers with the API key" in log
    )


def test_every_log_line_of_a_request_names_it(keyed_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=keyed_server.api_url, api_key="sk-test-secret-4242", max_retries=0
    )
    client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=2,
        extra_headers={"x-request-id": "trace-me-7"},
    )
    lines = [
        line for line in keyed_server.log_path.read_text().splitlines() if "trace-me-7" in line
    ]
    assert lines, "the request was logged"
    for line in lines:
        assert re.search(r"\[[^\]]*trace-me-7[^\]]*\]", line), line


def test_request_timeout_is_a_408_and_frees_the_slot(tmp_path: Path) -> None:
    proc = start_server(tmp_path, "--slots", "1", "--request-timeout", "1")
    try:
        body = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
        response = httpx.post(f"{proc.api_url}/completions", json=body, timeout=60)
        assert response.status_code == 408
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
        assert "--request-timeout" in error["message"]
        with httpx.stream(
            "POST", f"{proc.api_url}/completions", json={**body, "stream": True}, timeout=60
        ) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert '"code":408' in lines[-2] and lines[-1] == "data: [DONE]"
        assert wait_until(lambda: proc.slots()["slots"][0]["state"] == "free")
        ok = httpx.post(f"{proc.api_url}/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert re.search(r"slotserve:request_timeouts_total\{[^}]*\} 2\.0", metrics)
    finally:
        stop_server(proc)


def test_slow_steps_are_logged_with_their_requests(tmp_path: Path) -> None:
    proc = start_server(tmp_path, "--slots", "1", "--slow-step-warn", "0.000001")
    try:
        httpx.post(
            f"{proc.api_url}/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            headers={"x-request-id": "slowpoke"},
        )
    finally:
        stop_server(proc)
    assert re.search(r"WARNING .*slow step: .*cmpl-slowpoke", proc.log_path.read_text())


def _start_stream(proc: ServerProcess, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streaming completion read on a thread; returns the thread and its SSE lines so far,
    once the stream is running."""
    events: list[str] = []
    body = {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{proc.api_url}/completions", json=body, timeout=120) as r:
            events.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_until(lambda: len(events) >= 2), "the stream is running"
    return reader, events


def test_sigterm_drains_in_flight_streams_refuses_new_work_and_exits_zero(
    tmp_path: Path,
) -> None:
    proc = start_server(tmp_path, "--slots", "2", "--shutdown-timeout", "60")
    try:
        # Long enough to be in flight when the signal lands; the drain log proves it was.
        reader, events = _start_stream(proc, max_tokens=200)
        proc.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: _ready_status(proc) == 503), "readiness fails while draining"
        refused = httpx.post(f"{proc.api_url}/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]
        reader.join(timeout=120)
        assert not reader.is_alive(), "the stream ended"
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2], "the in-flight stream ran to its end"
        assert proc.process.wait(timeout=60) == 0
        log = proc.log_path.read_text()
        assert "waiting up to 60 s for 1 in flight" in log, "the stream was in flight"
        assert "drained: 1 requests finished, 0 aborted" in log
    finally:
        if proc.process.poll() is None:
            stop_server(proc)


def test_streams_past_the_shutdown_deadline_end_with_finish_reason_abort(
    tmp_path: Path,
) -> None:
    proc = start_server(tmp_path, "--slots", "2", "--shutdown-timeout", "0.5")
    try:
        reader, events = _start_stream(proc, max_tokens=1500)
        started = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert not reader.is_alive(), "the stream ended"
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"abort"' in events[-2]
        assert proc.process.wait(timeout=60) == 0
        assert time.monotonic() - started < 30
        log = proc.log_path.read_text()
        assert "aborting 1 requests" in log
    finally:
        if proc.process.poll() is None:
            stop_server(proc)


def _ready_status(proc: ServerProcess) -> int:
    try:
        return httpx.get(f"{proc.base_url}/ready", timeout=2).status_code
    except httpx.TransportError:
        return -1


def test_exit_status_is_one_when_the_model_cannot_load(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF but not really")
    result = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "serve", str(bogus), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "the model failed to load" in result.stderr
