"""Edges of a served model's life (loading, reloading, shutdown), against real servers
spawned on loopback with the embedded SmolLM2 GGUF, through HTTP only (``/v1/...``,
``/v1/slots``, ``/metrics``, ``/health``, ``/ready``): clients that leave while the model loads,
reloads under live streams, counters across reloads, several prompts × ``n``, and a second
SIGTERM during the drain (two requests sharing one ``x-request-id`` are in
test_shared_request_ids.py). Every wait is on a state (polled with a deadline) or an event,
never a fixed sleep.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.prompts import PROMPTS
from tests.server.gated_serve import GATE_ENV
from tests.server.lifecycle_helpers import (
    LONG,
    MODEL,
    Samples,
    StreamReader,
    assert_openai_error,
    choices_by_index,
    greedy_text,
    idle,
    metric,
    ready_status,
    running_request_ids,
    scrape,
)

pytestmark = pytest.mark.slow  # its tests start servers of their own


# ---- a. clients that leave while the model loads ------------------------------------------------


def test_requests_abandoned_while_the_model_loads_leave_nothing_behind(tmp_path: Path) -> None:
    gate = tmp_path / "load-gate"
    proc = start_server(
        tmp_path,
        "--slots",
        "2",
        env={GATE_ENV: str(gate)},
        module="tests.server.gated_serve",
        until="listening",
    )
    try:
        host, port = proc.base_url.removeprefix("http://").split(":")
        assert httpx.get(f"{proc.base_url}/health").json()["status"] == "loading"
        assert ready_status(proc) == 503
        body = json.dumps({"prompt": "Hello", "max_tokens": 50, "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        # 1. Leaves half-way through sending its body.
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + body[: len(body) // 2])
        # 2. Sends a whole streaming request and leaves without reading the answer.
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + body)
        # 3. The real client, streaming: a 503 that says to retry, with Retry-After.
        client = openai.OpenAI(base_url=proc.api_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True)
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body is not None and "loading" in str(refused.value.body)
        # 4. A chat request, read: the same 503 in OpenAI's shape.
        chat = httpx.post(
            f"{proc.api_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        )
        assert chat.status_code == 503 and chat.headers["retry-after"]
        assert assert_openai_error(chat)["code"] == "model_unavailable"
        # The server answered the abandoned whole request too (it counts every 503 it sends).
        assert wait_until(
            lambda: (
                metric(
                    scrape(proc.base_url)[0],
                    "slotserve:http_errors_total",
                    status="503",
                    type="service_unavailable",
                )
                == 3
            ),
            timeout=30,
        )
        assert httpx.get(f"{proc.base_url}/health").json()["status"] == "loading", (
            "all of the above happened while the model was loading"
        )

        gate.touch()
        assert wait_until(lambda: ready_status(proc) == 200, timeout=120)
        assert idle(proc), proc.slots()
        slots = proc.slots()
        assert slots["requests_submitted"] == 0, "no abandoned request reached the engine"
        assert slots["kv_used_tokens"] == 0
        samples, _ = scrape(proc.base_url)
        assert metric(samples, "vllm:num_requests_running") == 0
        assert metric(samples, "vllm:num_requests_waiting") == 0
        assert metric(samples, "slotserve:slots", state="free") == 2
        for reason in ("stop", "length", "abort", "error"):
            assert metric(samples, "vllm:request_success_total", finished_reason=reason) == 0
        server_errors = {
            labels: v
            for (name, labels), v in samples.items()
            if name == "slotserve:http_errors_total"
            and dict(labels)["status"].startswith("5")
            and dict(labels)["status"] != "503"
        }
        assert server_errors == {}, "leaving early is never a server error"
        # And the server serves: exactly one request reaches the engine, and ends.
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert wait_until(lambda: idle(proc) and proc.slots()["requests_finished"] == 1)
        assert proc.slots()["requests_submitted"] == 1
    finally:
        stop_server(proc)


# ---- b, c. reloads ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reload_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("reload"), "--slots", "4")
    yield proc
    stop_server(proc)


def _reload(server: ServerProcess) -> int:
    before = int(metric(scrape(server.base_url)[0], "slotserve:model_loads_total"))
    response = httpx.post(f"{server.base_url}/admin/reload", timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "ready" and response.json()["loads"] == before + 1
    return before + 1


def test_reload_ends_every_live_stream_and_serves_the_same_greedy_text(
    reload_server: ServerProcess,
) -> None:
    server = reload_server
    before = greedy_text(server, PROMPTS[0], max_tokens=12)
    readers = [
        StreamReader(server, {"prompt": p, "max_tokens": LONG, "ignore_eos": True})
        for p in PROMPTS[1:4]
    ]
    try:
        for reader in readers:
            assert reader.first_chunk.wait(60) and reader.status == 200
        assert wait_until(lambda: len(running_request_ids(server)) == 3), "three streams are live"
        _reload(server)
        for reader in readers:
            assert reader.wait(30), "a stream of the old engine hangs after the reload"
            assert reader.error is None, reader.error
            assert reader.lines[-1] == "data: [DONE]" and reader.lines.count("data: [DONE]") == 1
            last = json.loads(reader.lines[-2][6:])
            if "error" in last:  # ended by the reload: an error event in OpenAI's shape
                assert last["error"]["message"] and last["error"]["type"], last
                assert last["error"]["code"] == 503, "a reload is no internal error"
            else:
                assert last["choices"][0]["finish_reason"] in ("stop", "length", "abort"), last
            generated = "".join(c["text"] for e in reader.events() for c in e.get("choices", []))
            assert generated, "the stream had produced text before the reload"
    finally:
        for reader in readers:
            reader.leave()
    assert wait_until(lambda: idle(server))
    assert greedy_text(server, PROMPTS[0], max_tokens=12) == before
    assert idle(server)


def _traffic(server: ServerProcess, prompts: list[str]) -> None:
    for prompt in prompts:
        greedy_text(server, prompt, max_tokens=4)
    bad = httpx.post(f"{server.api_url}/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    assert wait_until(lambda: idle(server))


def _monotonic_samples(kinds: dict[str, str], name: str) -> bool:
    """Counters (``*_total``) and the cumulative series of histograms."""
    if name.endswith("_created"):
        return False  # creation timestamps, not counts
    kind = kinds.get(name)
    return (kind == "counter" and name.endswith("_total")) or (
        kind == "histogram" and name.endswith(("_count", "_sum", "_bucket"))
    )


def _went_back(before: Samples, after: Samples, kinds: dict[str, str]) -> dict[Any, Any]:
    return {
        key: (value, after.get(key))
        for key, value in before.items()
        if _monotonic_samples(kinds, key[0]) and after.get(key, -1.0) < value
    }


def test_counters_never_go_back_across_a_reload(reload_server: ServerProcess) -> None:
    server = reload_server
    _traffic(server, PROMPTS[:4])
    before, kinds = scrape(server.base_url)
    checked = [key for key in before if _monotonic_samples(kinds, key[0])]
    assert len(checked) > 20, "the scrape exposes the counters"
    assert metric(before, "vllm:prefix_cache_queries_total") > 0, "the cache saw the traffic"

    # Scrapes while the reload runs (the model is out meanwhile) must not go back either.
    during: list[Samples] = []
    with ThreadPoolExecutor(1) as pool:
        reloading = pool.submit(_reload, server)
        while not reloading.done():
            during.append(scrape(server.base_url)[0])
        reloading.result()  # the reload's own assertions
    for sample in during:
        assert _went_back(before, sample, kinds) == {}, "a scrape during the reload"

    _traffic(server, PROMPTS[4:5])  # less traffic than before: a reset would show
    after, _ = scrape(server.base_url)
    assert _went_back(before, after, kinds) == {}
    for name in (
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "slotserve:engine_steps_total",
        "slotserve:model_loads_total",
    ):
        assert metric(after, name) > metric(before, name), f"{name} counted the new traffic"


# ---- d. several prompts × n ------------------------------------------------------------------


def test_several_prompts_times_n_are_indexed_k_times_n_plus_i(server: ServerProcess) -> None:
    prompts, n, max_tokens = PROMPTS[:3], 2, 6
    body = {
        "prompt": prompts,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    alone = [greedy_text(server, p, max_tokens) for p in prompts]
    assert len(set(alone)) == len(prompts), "the prompts continue differently"

    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    reply = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    indices = [c.index for c in reply.choices]
    assert sorted(indices) == list(range(len(prompts) * n)), indices
    text = {c.index: c.text for c in reply.choices}
    for k, expected in enumerate(alone):
        for i in range(n):
            assert text[k * n + i] == expected, f"choice {k * n + i} is prompt {k}'s sequence {i}"
    assert {c.finish_reason for c in reply.choices} == {"length"}
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(prompts) * n * max_tokens

    reader = StreamReader(server, body)
    assert reader.wait(120) and reader.error is None and reader.status == 200
    assert reader.lines[-1] == "data: [DONE]"
    streamed, finishes = choices_by_index(reader.events())
    assert sorted(streamed) == list(range(len(prompts) * n))
    assert finishes == {index: ["length"] for index in range(len(prompts) * n)}, (
        "each choice has exactly one finish_reason"
    )
    assert streamed == text, "streamed choices carry the same text under the same index"


# ---- f. a second SIGTERM during the drain ------------------------------------------------------

SHUTDOWN_TIMEOUT_S = 120


def _second_sigterm_during_drain(tmp_path: Path) -> tuple[int, float, StreamReader, str]:
    """A server with a long drain and one live stream gets SIGTERM, then (once it is visibly
    draining) a second SIGTERM. Returns the exit status, the seconds from the second signal to
    the exit, the stream and the log."""
    proc = start_server(tmp_path, "--slots", "2", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        reader = StreamReader(proc, {"prompt": "Count:", "max_tokens": LONG, "ignore_eos": True})
        assert reader.first_chunk.wait(60) and reader.status == 200
        proc.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: ready_status(proc) == 503), "the first signal starts the drain"
        assert not reader.done.is_set(), "the stream is in flight during the drain"
        second = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        status = proc.process.wait(timeout=SHUTDOWN_TIMEOUT_S / 4)
        exited_after = time.monotonic() - second
        assert reader.wait(30), "the stream ended with the process"
        return status, exited_after, reader, proc.log_path.read_text()
    finally:
        if proc.process.poll() is None:
            stop_server(proc)


def test_a_second_sigterm_skips_the_drain_and_exits_zero_promptly(tmp_path: Path) -> None:
    status, exited_after, _, log = _second_sigterm_during_drain(tmp_path)
    assert status == 0
    assert exited_after < SHUTDOWN_TIMEOUT_S / 4, "the second signal skipped the wait"
    assert "second signal" in log


def test_a_second_sigterm_ends_in_flight_streams_with_abort_and_done(tmp_path: Path) -> None:
    status, _, reader, _ = _second_sigterm_during_drain(tmp_path)
    assert status == 0
    assert reader.error is None, f"the stream was cut: {reader.error!r}"
    assert reader.lines[-1] == "data: [DONE]"
    _, finishes = choices_by_index(reader.events())
    assert finishes == {0: ["abort"]}
