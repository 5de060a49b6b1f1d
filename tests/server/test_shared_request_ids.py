"""Two requests sharing one ``x-request-id``, against a real server spawned on loopback with the
embedded SmolLM2 GGUF, through HTTP only: concurrent streams, multi-prompt requests and
completions, and an id reused right after its client left are each served independently. Every
wait is on a state (polled with a deadline) or an event, never a fixed sleep.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.prompts import PROMPTS
from tests.server.lifecycle_helpers import (
    LONG,
    StreamReader,
    assert_openai_error,
    choices_by_index,
    greedy_text,
    idle,
    ready_status,
    running_request_ids,
)

pytestmark = pytest.mark.slow  # its tests start servers of their own


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
