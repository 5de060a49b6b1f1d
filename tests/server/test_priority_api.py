"""Request priority through every API (vLLM's ``priority`` field; an extra body field on the
Messages and Responses APIs): under ``--schedule-policy priority`` a later request of higher
priority takes the next free slot; under any other policy a priority is a 400 naming the flag."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("priority"), "--slots", "1", "--schedule-policy", "priority"
    )
    yield proc
    stop_server(proc)


def test_every_api_takes_a_priority(priority_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=priority_server.api_url, api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"priority": -3},
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 7}
    )
    assert text.choices[0].finish_reason in ("stop", "length")
    reply = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, extra_body={"priority": 1}
    )
    assert reply.status in ("completed", "incomplete")
    messages = anthropic.Anthropic(base_url=priority_server.base_url, api_key="x", max_retries=0)
    message = messages.messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"priority": 2},
    )  # fmt: skip
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_a_later_request_of_higher_priority_goes_first(priority_server: ServerProcess) -> None:
    """One slot, held by a streaming request; a low-priority request queues, then a
    high-priority one; the stream is dropped (freeing the slot): the high one goes first."""
    url = f"{priority_server.api_url}/completions"
    finished: list[str] = []

    def run(name: str, priority: int) -> None:
        body = {"model": MODEL, "prompt": f"{name}:", "max_tokens": 4, "priority": priority}
        assert httpx.post(url, json=body, timeout=120).status_code == 200
        finished.append(name)

    def queued() -> int:
        return int(httpx.get(f"{priority_server.base_url}/v1/slots").json()["num_waiting"])

    blocker = {"model": MODEL, "prompt": "Go on:", "max_tokens": 2000, "ignore_eos": True,
               "stream": True}  # fmt: skip
    threads = [threading.Thread(target=run, args=args) for args in (("low", 5), ("high", -1))]
    with httpx.stream("POST", url, json=blocker, timeout=120) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # generating: the slot is taken
        for waiting, thread in enumerate(threads, start=1):
            thread.start()
            assert wait_until(lambda n=waiting: queued() == n, timeout=30)  # type: ignore[misc]
    for thread in threads:
        thread.join(timeout=120)
    assert finished == ["high", "low"]


def test_a_priority_without_the_priority_policy_is_a_400(server: ServerProcess) -> None:
    reply = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "priority": 1},
        timeout=30,
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "priority" and "--schedule-policy priority" in error["message"]
