"""Nothing heavy on the API process's event loop: while requests of 50 MB arrive, /health and
a small chat request still answer at once. Over --max-request-bytes such a request is a 413
before it is parsed; under it, a prompt that cannot fit the context is refused from its length
in characters, before it is tokenized."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from slotserve.server.serving import MIN_REQUEST_BYTES
from tests.conftest import ServerProcess, start_server, stop_server

BIG = 50 * 10**6
SENDERS = 3  # big requests in flight at once
# Per probe: the median is what a client usually waits; the worst one, what a blocked event
# loop would show (it held /health for seconds before).
MEDIAN_BOUND_S = 0.1
WORST_BOUND_S = 1.0
PARSING_BOUND_S = 0.5
CPU_SHARE = 4  # how much slower the runner may be while the uploads take the cores
# One runner thread: the clients sending 50 MB need a core of their own on a small machine.
SERVER_ARGS = ("--slots", "2", "--threads", "1")


def chat_body(content: str, max_tokens: int = 1) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


BIG_CHAT = json.dumps(chat_body("hello " * (BIG // 6))).encode()
# The length stated, so the body streamed from uploading() goes out as bytes would, not chunked.
BIG_HEADERS = {"content-type": "application/json", "content-length": str(len(BIG_CHAT))}


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("loop"), *SERVER_ARGS)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("roomy"), *SERVER_ARGS, "--max-request-bytes", "128MiB"
    )
    yield server
    stop_server(server)


def health(probe: httpx.Client) -> float:
    started = time.monotonic()
    assert probe.get("/health").status_code == 200
    return time.monotonic() - started


def small_chat(probe: httpx.Client) -> float:
    started = time.monotonic()
    assert probe.post("/v1/chat/completions", json=chat_body("Hi")).status_code == 200
    return time.monotonic() - started


def uploading(body: bytes, begun: threading.Event, piece: int = 2**20) -> Iterator[bytes]:
    """``body`` in pieces, for a request that states its Content-Length (so it is sent as the
    bytes themselves are, not chunked); sets ``begun`` once the first piece has been written,
    after the request line and headers."""
    for start in range(0, len(body), piece):
        yield body[start : start + piece]
        begun.set()


def under_load(
    server: ServerProcess, probes: int = 20
) -> tuple[list[httpx.Response], list[float], list[float], tuple[float, float]]:
    """``BIG_CHAT`` posted from ``SENDERS`` threads, one after another, while this thread times
    ``probes`` rounds of /health and a small chat request, from when every sender's first
    upload is on the wire; returns the big answers and both probes' latencies, and their
    medians before the load."""
    with httpx.Client(base_url=server.base_url, timeout=60) as probe:
        probe.get("/health")  # connect before timing
        idle = (
            statistics.median(health(probe) for _ in range(5)),
            statistics.median(small_chat(probe) for _ in range(5)),
        )
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    done = threading.Event()

    def sender(begun: threading.Event) -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                body = uploading(BIG_CHAT, begun)
                answer = client.post(
                    f"{server.api_url}/chat/completions", content=body, headers=BIG_HEADERS
                )
                with lock:
                    answers.append(answer)

    uploads = [threading.Event() for _ in range(SENDERS)]
    threads = [threading.Thread(target=sender, args=(e,), daemon=True) for e in uploads]
    for thread in threads:
        thread.start()
    healths: list[float] = []
    chats: list[float] = []
    with httpx.Client(base_url=server.base_url, timeout=60) as probe:
        probe.get("/health")  # connect before timing
        deadline = time.monotonic() + 60
        for begun in uploads:  # the big uploads are under way
            assert begun.wait(max(0.0, deadline - time.monotonic())), "an upload never began"
        while len(healths) < probes or len(answers) < SENDERS:
            healths.append(health(probe))
            chats.append(small_chat(probe))
            time.sleep(0.02)
    done.set()
    for thread in threads:
        thread.join(120)
    return answers, healths, chats, idle


def assert_fast(
    name: str, latencies: list[float], idle: float = 0.0, parsing: bool = False
) -> None:
    """The median within ``MEDIAN_BOUND_S`` of ``idle`` (the same request's median with no
    load; a generation also waits for the runner, which shares the machine with the uploads,
    hence a factor), the worst within ``WORST_BOUND_S`` of it. ``parsing``: the big bodies
    are under the size limit, and the event loop still parses their JSON (a fraction of a
    second each, not the seconds tokenizing took): ``PARSING_BOUND_S`` more."""
    assert len(latencies) >= 5, f"too few {name} probes to judge: {latencies}"
    median, worst = statistics.median(latencies), max(latencies)
    print(
        f"{name}: {len(latencies)} probes, median {median * 1000:.0f} ms, worst "
        f"{worst * 1000:.0f} ms (idle median {idle * 1000:.0f} ms)"
    )
    extra = PARSING_BOUND_S if parsing else 0.0
    assert median < CPU_SHARE * idle + MEDIAN_BOUND_S + extra, f"{name} median {median:.3f} s"
    assert worst < CPU_SHARE * idle + WORST_BOUND_S + extra, f"{name} worst {worst:.3f} s"


def test_a_body_over_the_limit_is_a_413_and_the_loop_stays_free(
    default_server: ServerProcess,
) -> None:
    answers, healths, chats, idle = under_load(default_server)
    assert len(answers) >= SENDERS
    for answer in answers:
        assert answer.status_code == 413, answer.text
        error = answer.json()["error"]
        assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert_fast("/health", healths, idle[0])
    assert_fast("small chat", chats, idle[1])


def test_a_chunked_body_is_counted_as_it_arrives(default_server: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        piece = b" " * 2**20
        for _ in range(MIN_REQUEST_BYTES // len(piece) + 4):
            yield piece

    answer = httpx.post(
        f"{default_server.api_url}/chat/completions",
        content=chunks(),  # no Content-Length: sent chunked
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"
    # Under the limit, a chunked body is read as any other.
    small = json.dumps(chat_body("Hi")).encode()
    ok = httpx.post(
        f"{default_server.api_url}/chat/completions",
        content=iter([small[:10], small[10:]]),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_the_messages_api_gets_anthropics_413(default_server: ServerProcess) -> None:
    body = {
        "model": "x",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hello " * (MIN_REQUEST_BYTES // 5)}],
    }
    answer = httpx.post(f"{default_server.api_url}/messages", json=body, timeout=60)
    assert answer.status_code == 413
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "request_too_large"


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(
    roomy_server: ServerProcess,
) -> None:
    answers, healths, chats, idle = under_load(roomy_server)
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "characters" in error["message"], "refused from its length, untokenized"
    assert_fast("/health", healths, idle[0], parsing=True)
    assert_fast("small chat", chats, idle[1], parsing=True)
    # The same bound on the completions route; a prompt that fits is not refused by it.
    long_prompt = {"prompt": "hello " * 400_000, "max_tokens": 1}
    refused = httpx.post(f"{roomy_server.api_url}/completions", json=long_prompt, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in refused.json()["error"]["message"]
    fits = {"prompt": "hello " * 500, "max_tokens": 1}
    assert httpx.post(f"{roomy_server.api_url}/completions", json=fits, timeout=60).is_success

    # Counting routes count what generation refuses.
    counted = httpx.post(
        f"{roomy_server.base_url}/tokenize", json={"prompt": "hello " * 400_000}, timeout=60
    )
    assert counted.status_code == 200 and counted.json()["count"] >= 400_000
