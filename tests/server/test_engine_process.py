"""The engine core in its own process behind a real server: the same greedy tokens as the
in-thread engine, a killed engine process (with --engine-restart never) turns the model
unhealthy and a reload brings a new one, and the engine process never outlives its server.
Restarts by themselves: test_engine_restart.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

pytestmark = pytest.mark.slow  # its tests start servers of their own

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
]


def engine_pid(server: ServerProcess) -> int:
    """The server's engine-core child (multiprocessing's spawn launcher names it)."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
    for pid in map(int, children.read_text().split()):
        with contextlib.suppress(FileNotFoundError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return pid
    raise AssertionError("the server has no engine process")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it runs nothing and holds no memory.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def process_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Restarts off: the killed-engine test shows the unhealthy state and the reload.
    proc = start_server(
        tmp_path_factory.mktemp("proc"),
        "--slots",
        "4",
        "--engine-process",
        "--engine-restart",
        "never",
    )
    yield proc
    stop_server(proc)


def greedy(server: ServerProcess) -> list[tuple[str, list[float]]]:
    """Every prompt at once, 24 greedy tokens each, with their log-probabilities."""

    async def main() -> list[tuple[str, list[float]]]:
        client = openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    logprobs=1,
                    extra_body={"ignore_eos": True},
                )
                for prompt in PROMPTS
            )
        )
        out = []
        for reply in replies:
            choice = reply.choices[0]
            assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
            out.append((choice.text, [float(x) for x in choice.logprobs.token_logprobs]))
        return out

    return asyncio.run(main())


def test_greedy_tokens_are_those_of_the_in_thread_engine(
    process_server: ServerProcess, tmp_path: Path
) -> None:
    threaded = start_server(tmp_path, "--slots", "4", "--no-engine-process")
    try:
        assert greedy(process_server) == greedy(threaded)
    finally:
        stop_server(threaded)


def test_a_killed_engine_process_is_reported_and_reload_recovers(
    process_server: ServerProcess,
) -> None:
    base = process_server.base_url
    before = greedy(process_server)[0][0]
    pid = engine_pid(process_server)
    with httpx.stream(
        "POST",
        f"{process_server.api_url}/completions",
        json={"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "stream": True},
        timeout=30,
    ) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
        took = time.monotonic() - killed
    assert took < 5.0, f"the stream ended {took:.1f} s after the engine died"
    assert any('"error"' in line and "engine process died" in line for line in rest), rest
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert httpx.get(f"{base}/health").status_code == 503
    assert httpx.get(f"{base}/ready").status_code == 503
    refused = httpx.post(f"{process_server.api_url}/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and "/admin/reload" in refused.text

    assert httpx.post(f"{base}/admin/reload", timeout=120).status_code == 200
    assert httpx.get(f"{base}/ready").status_code == 200
    new_pid = engine_pid(process_server)
    assert new_pid != pid
    assert greedy(process_server)[0][0] == before


def test_the_engine_process_dies_with_its_server(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--slots", "2", "--engine-process")
    pid = engine_pid(server)
    server.process.kill()  # SIGKILL: the server gets no chance to stop its engine
    server.process.wait()
    assert wait_until(lambda: not alive(pid), timeout=10), "the engine process outlived its server"


def test_sigterm_stops_the_engine_process_with_the_server(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--slots", "2", "--engine-process")
    pid = engine_pid(server)
    stop_server(server)  # SIGTERM: drain, then stop the engine
    assert server.process.returncode == 0
    assert not alive(pid)
