"""Edges of a served model's life (loading, reloading, request ids, shutdown), against real servers
spawned on loopback with the embedded SmolLM2 GGUF, through HTTP only (``/v1/...``,
``/v1/slots``, ``/metrics``, ``/health``, ``/ready``): clients that leave while the model loads,
reloads under live streams, counters across reloads, several prompts × ``n``, two requests
sharing one ``x-request-id``, and a second SIGTERM during the drain. Every wait is on a state
(polled with a deadline) or an event, never a fixed sleep.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.prompts import PROMPTS
from tests.server.gated_serve import GATE_ENV

pytestmark = pytest.mark.slow  # its tests start servers of their own

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Long enough that a stream is still generating whatever the machine's speed when the test acts
# on it (several seconds of decoding on the 2-core CI machine), short of every slot's context.
LONG = 3000

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# ---- helpers ----------------------------------------------------------------------------------


def scrape(base_url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample of ``/metrics`` keyed by name and sorted labels, and each sample name's
    family type (counter, gauge, histogram)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples: Samples = {}
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            kinds[sample.name] = family.type
    return samples, kinds


def metric(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return float(samples.get(key, 0.0))


def idle(server: ServerProcess) -> bool:
    """No request anywhere in the engine: every slot free and holding no request, none queued."""
    slots = server.slots()
    return (
        slots["state"] == "ready"
        and slots["num_running"] == 0
        and slots["num_waiting"] == 0
        and all(s["state"] == "free" and s["request_id"] is None for s in slots["slots"])
    )


def running_request_ids(server: ServerProcess) -> set[str]:
    return {s["request_id"] for s in server.slots()["slots"] if s["state"] == "generating"}


def ready_status(server: ServerProcess) -> int:
    try:
        return httpx.get(f"{server.base_url}/ready", timeout=2).status_code
    except httpx.TransportError:
        return -1


def greedy_text(server: ServerProcess, prompt: str, max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    return error


class StreamReader:
    """A streaming completion read to its end on a thread; ``lines`` are its non-empty SSE
    lines so far, ``first_chunk`` is set once a generated chunk arrived, ``done`` at the end."""

    def __init__(self, server: ServerProcess, body: dict[str, Any], **headers: str) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.status: int | None = None
        self.first_chunk = threading.Event()
        self.done = threading.Event()
        self._leave = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(server, {**body, "stream": True}, headers), daemon=True
        )
        self._thread.start()

    def _read(self, server: ServerProcess, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            with httpx.stream(
                "POST", f"{server.api_url}/completions", json=body, headers=headers, timeout=300
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if self._leave.is_set():
                        return  # leaving the block closes the connection: a disconnect
                    if line:
                        self.lines.append(line)
                        if line.startswith("data: {") and '"choices":[{' in line:
                            self.first_chunk.set()
        except BaseException as exc:  # the test thread reports it
            self.error = exc
        finally:
            self.first_chunk.set()  # never leave a waiter hanging on a stream that failed
            self.done.set()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)

    def leave(self, timeout: float = 30) -> None:
        """The client disconnects (at its next line) and the thread ends."""
        self._leave.set()
        assert self.wait(timeout), "the reader thread did not end"


def choices_by_index(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Text and every non-null finish reason per choice index of a completion stream."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for event in events:
        for choice in event.get("choices", []):
            index = choice["index"]
            texts[index] = texts.get(index, "") + choice["text"]
            finishes.setdefault(index, [])
            if choice["finish_reason"] is not None:
                finishes[index].append(choice["finish_reason"])
    return texts, finishes


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


# ---- e. two requests with the same x-request-id ----------------------------------------------


@pytest.fixture(scope="module")
def dup_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("dup"), "--slots", "4")
    yield proc
    stop_server(proc)


@pytest.fixture
def healthy_dup_server(dup_server: ServerProcess) -> Iterator[ServerProcess]:
    """The server, healthy and idle before and after the test (a test that breaks it reloads it,
    so the next one starts clean)."""
    assert ready_status(dup_server) == 200 and wait_until(lambda: idle(dup_server))
    yield dup_server
    if ready_status(dup_server) != 200:
        httpx.post(f"{dup_server.base_url}/admin/reload", timeout=120)
    assert wait_until(lambda: ready_status(dup_server) == 200 and idle(dup_server))


def test_two_concurrent_streams_with_one_request_id_are_served_independently(
    healthy_dup_server: ServerProcess,
) -> None:
    server = healthy_dup_server
    expected = [greedy_text(server, p, max_tokens=24) for p in PROMPTS[:2]]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    first = StreamReader(server, {**body, "prompt": PROMPTS[0]}, **{"x-request-id": "same-id"})
    assert first.first_chunk.wait(60)
    second = StreamReader(server, {**body, "prompt": PROMPTS[1]}, **{"x-request-id": "same-id"})
    for reader, text in zip((first, second), expected, strict=True):
        assert reader.wait(60) and reader.error is None and reader.status == 200
        assert reader.lines[-1] == "data: [DONE]"
        streamed, finishes = choices_by_index(reader.events())
        assert streamed == {0: text} and finishes == {0: ["length"]}
    ids = [{e["id"] for e in reader.events()} for reader in (first, second)]
    assert all(len(i) == 1 for i in ids) and ids[0] != ids[1], f"completion ids {ids}"
    assert all("same-id" in next(iter(i)) for i in ids), "the engine id names the client's id"
    assert wait_until(lambda: idle(server)) and ready_status(server) == 200


def test_two_multi_prompt_requests_with_one_request_id_are_served_independently(
    healthy_dup_server: ServerProcess,
) -> None:
    server = healthy_dup_server
    first = StreamReader(
        server,
        {"prompt": PROMPTS[:2], "max_tokens": LONG, "ignore_eos": True},
        **{"x-request-id": "multi-id"},
    )
    try:
        assert first.first_chunk.wait(60)
        assert wait_until(lambda: len(running_request_ids(server)) == 2), "the first runs"
        prompts = PROMPTS[2:4]
        expected = [greedy_text(server, p, max_tokens=6) for p in prompts]
        second = httpx.post(
            f"{server.api_url}/completions",
            json={"prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            headers={"x-request-id": "multi-id"},
            timeout=60,
        )
        assert len(running_request_ids(server)) == 2, "the first was in flight all along"
    finally:
        first.leave()
    if 400 <= second.status_code < 500:  # refusing is allowed, if clearly
        assert_openai_error(second)
    else:
        assert second.status_code == 200, second.text
        reply = second.json()
        assert [c["text"] for c in reply["choices"]] == expected
        assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert first.error is None and first.status == 200
    streamed, finishes = choices_by_index(first.events())
    assert set(streamed) == {0, 1} and all(streamed.values()), "the first kept its own choices"
    assert finishes == {0: [], 1: []}, "the first was still generating when its client left"
    assert wait_until(lambda: idle(server)) and ready_status(server) == 200


def test_two_multi_prompt_completions_with_one_request_id_get_distinct_ids(
    healthy_dup_server: ServerProcess,
) -> None:
    server = healthy_dup_server
    body = {"prompt": PROMPTS[:2], "max_tokens": LONG, "ignore_eos": True}
    first = StreamReader(server, body, **{"x-request-id": "multi-ids"})
    try:
        assert first.first_chunk.wait(60)
        second = httpx.post(
            f"{server.api_url}/completions",
            json={**body, "max_tokens": 2},
            headers={"x-request-id": "multi-ids"},
            timeout=60,
        )
        assert not first.done.is_set(), "the first was in flight all along"
    finally:
        first.leave()
    assert second.status_code == 200, second.text
    first_ids = {e["id"] for e in first.events()}
    assert len(first_ids) == 1 and second.json()["id"] not in first_ids


def test_an_id_reused_right_after_its_client_left_is_served_and_harms_nothing(
    healthy_dup_server: ServerProcess,
) -> None:
    server = healthy_dup_server
    expected = greedy_text(server, PROMPTS[5], max_tokens=8)
    for attempt in range(3):
        request_id = f"reused-{attempt}"
        with httpx.Client(timeout=60) as http:
            request = http.build_request(
                "POST",
                f"{server.api_url}/completions",
                json={"prompt": "Count:", "max_tokens": LONG, "ignore_eos": True, "stream": True},
                headers={"x-request-id": request_id},
            )
            left = http.send(request, stream=True)
            lines = left.iter_lines()
            assert next(lines).startswith("data: {"), "the stream is generating"
            left.close()  # the client leaves mid-stream
        again = httpx.post(
            f"{server.api_url}/completions",
            json={"prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            headers={"x-request-id": request_id},
            timeout=60,
        )
        if 400 <= again.status_code < 500:
            assert_openai_error(again)
        else:
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == expected
            assert again.json()["choices"][0]["finish_reason"] == "length"
        assert ready_status(server) == 200, httpx.get(f"{server.base_url}/health").text
        assert wait_until(lambda: idle(server)), server.slots()


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
