"""A dead engine comes back by itself: the requests in it end with an error, new ones get a
503 with Retry-After while it restarts, then the model serves again, and the restart is
counted. A crash loop leaves the model failed, with the reason in /health and /v1/models; a
reload then starts it again. (--engine-restart never: test_engine_process.py.)"""

from __future__ import annotations

import functools
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path,
        "--slots",
        "2",
        "--engine-restart-limit",
        "3",
        "--engine-restart-window",
        "600",
    )
    yield proc
    stop_server(proc)


def engine_pid(server: ServerProcess) -> int:
    return int(server.slots()["engine_pid"])


def ready(server: ServerProcess) -> bool:
    return httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200


def restarted(server: ServerProcess, pid: int) -> bool:
    """Ready again, with another engine process than ``pid``."""
    return ready(server) and engine_pid(server) != pid


def restarts(server: ServerProcess) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    found = re.search(r"^slotserve:engine_restarts_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert found is not None, "no restart counter in /metrics"
    return float(found.group(1))


def complete(server: ServerProcess) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    return httpx.post(f"{server.api_url}/completions", json=body, timeout=60)


def kill_engine_under_a_stream(server: ServerProcess) -> list[str]:
    """Kills the engine process while a stream runs; returns the rest of the stream."""
    pid = engine_pid(server)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{server.api_url}/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
        os.kill(pid, signal.SIGKILL)
        return list(lines)


def test_a_killed_engine_restarts_by_itself(server: ServerProcess) -> None:
    assert restarts(server) == 0
    first = engine_pid(server)
    rest = kill_engine_under_a_stream(server)
    assert any('"error"' in line and "engine process died" in line for line in rest), rest
    assert [line for line in rest if line][-1] == "data: [DONE]"

    # Until the new engine is in: 503 with Retry-After, and liveness holds (it recovers).
    refused = complete(server)
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "restarted" in refused.json()["error"]["message"]
    health = httpx.get(f"{server.base_url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "loading"

    assert wait_until(lambda: ready(server), timeout=60, interval=0.1), "no restart"
    assert engine_pid(server) != first
    answer = complete(server)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    assert restarts(server) == 1
    assert httpx.get(f"{server.base_url}/health", timeout=5).json() == {"status": "ok"}


def test_a_crash_loop_leaves_the_model_failed(server: ServerProcess) -> None:
    for death in range(3):  # the third death within the window is the limit
        pid = engine_pid(server)
        os.kill(pid, signal.SIGKILL)
        if death < 2:
            back = functools.partial(restarted, server, pid)
            assert wait_until(back, timeout=60, interval=0.1), death

    def failed() -> bool:
        return httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503

    assert wait_until(failed, timeout=30, interval=0.1), "the crash loop went on"
    health = httpx.get(f"{server.base_url}/health", timeout=5).json()
    assert health["status"] == "failed"
    assert "died 3 times" in health["reason"] and "not restarted" in health["reason"]
    (entry,) = httpx.get(f"{server.api_url}/models", timeout=5).json()["data"]
    assert entry["state"] == "failed" and "died 3 times" in entry["reason"]
    refused = complete(server)
    assert refused.status_code == 503 and "/admin/reload" in refused.text
    assert restarts(server) == 2
    assert "not restarted again" in server.log_path.read_text()

    # A reload asked for starts afresh, with its deaths forgotten.
    assert httpx.post(f"{server.base_url}/admin/reload", timeout=120).status_code == 200
    assert complete(server).status_code == 200


def test_requests_right_after_a_death_are_told_when_to_come_back(server: ServerProcess) -> None:
    # The server looks at the engine process every half second; a request in between used to
    # find its socket gone and get a 503 saying "reload", without Retry-After (a client then
    # hammers the server until the restart). Now that request notices the death for all.
    os.kill(engine_pid(server), signal.SIGKILL)
    answers = [complete(server) for _ in range(20)]
    assert wait_until(lambda: ready(server), timeout=60, interval=0.1), "no restart"
    refused = [a for a in answers if a.status_code == 503 and "retry-after" in a.headers]
    assert refused, [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 503 and answer not in refused:
            assert "failed while serving this request" in answer.json()["error"]["message"]
        else:
            assert answer.status_code in (200, 503), answer.text
        assert "is unhealthy" not in answer.text, answer.text
    assert restarts(server) == 1
