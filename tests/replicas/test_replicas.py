"""R3: ``slotserve serve --replicas 2`` on a local Ray Serve instance (half a CPU per replica
on this 2-core box): prefix affinity through one URL, ``x-replica-id``, the deployment's
``/metrics`` and ``/v1/models``, and a killed replica: a stream it was serving ends with an
error event, new requests go to the survivor, and Ray brings the replica back."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[replicas]')")
pytestmark = [pytest.mark.model, pytest.mark.slow]  # Ray Serve, two replicas

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Long enough (~90 tokens) that a cache hit shows in cached_tokens.
SYSTEM = [
    f"You are assistant number {i}. " + f"Rule {i}: answer in one short sentence. " * 12
    for i in range(3)
]
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("replicas"),
        *("--replicas", "2", "--replica-cpus", "0.5", "--slots", "2", "--threads", "1"),
        env=RAY_ENV,
    )
    try:
        # Ready means one replica answers; the tests below need both (a replica whose start
        # failed is replaced by Ray meanwhile).
        assert wait_until(lambda: len(_replicas(server)) == 2, 120), "both replicas serving"
        yield server
    finally:
        pids = [row["actor_pid"] for row in _replicas(server)] + [
            row["server_pid"] for row in _replicas(server)
        ]
        stop_server(server)
        assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in alive), 30)


def _replicas(server: ServerProcess) -> list[dict]:  # type: ignore[type-arg]
    return list(httpx.get(f"{server.base_url}/v1/replicas", timeout=30).json()["data"])


def _chat(server: ServerProcess, system: str, user: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=120)


def test_requests_with_a_shared_prefix_go_to_one_replica(deployment: ServerProcess) -> None:
    placed: dict[int, set[str]] = {}
    cached: list[int] = []
    for user in range(4):
        for prefix, system in enumerate(SYSTEM):
            reply = _chat(deployment, system, f"Question {user}: what is {user} + {prefix}?")
            assert reply.status_code == 200, reply.text
            placed.setdefault(prefix, set()).add(reply.headers["x-replica-id"])
            if user:
                details = reply.json()["usage"].get("prompt_tokens_details") or {}
                cached.append(details.get("cached_tokens", 0))
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert len(set().union(*placed.values())) == 2, "distinct prefixes spread over both"
    assert all(tokens >= 64 for tokens in cached), cached


def test_the_deployment_answers_models_and_metrics(deployment: ServerProcess) -> None:
    client = OpenAI(base_url=deployment.api_url, api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
    )
    assert len([chunk for chunk in stream if chunk.choices]) >= 1
    text = httpx.get(f"{deployment.base_url}/metrics", timeout=30).text
    replica_ids = {row["replica_id"] for row in _replicas(deployment)}
    for replica_id in replica_ids:
        assert f'replica="{replica_id}"' in text
    bad = httpx.post(f"{deployment.api_url}/completions", json={"model": MODEL}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json(), "errors pass through as they are"


def test_a_client_that_disconnects_frees_its_slot_on_the_replica(
    deployment: ServerProcess,
) -> None:
    replicas = {row["replica_id"]: row for row in _replicas(deployment)}
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 2000, "stream": True}
    with httpx.stream(
        "POST", f"{deployment.api_url}/completions", json={**body, "ignore_eos": True}
    ) as response:
        replica = replicas[response.headers["x-replica-id"]]
        assert next(line for line in response.iter_lines() if line.startswith("data: "))

    def idle() -> bool:
        slots = httpx.get(f"{replica['url']}/v1/slots", timeout=10).json()
        return all(slot["state"] == "free" for slot in slots["slots"])

    assert wait_until(idle, timeout=30), "the replica's server freed the slot"


def test_a_killed_replica_ends_its_stream_and_is_replaced(deployment: ServerProcess) -> None:
    before = {row["replica_id"]: row for row in _replicas(deployment)}
    body = {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{deployment.api_url}/completions", json=body, timeout=120
    ) as response:
        victim = before[response.headers["x-replica-id"]]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(victim["actor_pid"], signal.SIGKILL)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events and "error" in json.loads(events[-1]), events[-3:]
    assert "replica" in json.loads(events[-1])["error"]["message"]
    # Meanwhile every new request is served (by the survivor until the replacement is up).
    for i in range(3):
        reply = _chat(deployment, SYSTEM[0], f"After the failure, question {i}")
        assert reply.status_code == 200, reply.text
    assert wait_until(
        lambda: (
            len(ids := {row["replica_id"] for row in _replicas(deployment)}) == 2
            and victim["replica_id"] not in ids
        ),
        timeout=120,
        interval=1.0,
    ), "Ray replaced the killed replica"
    assert wait_until(lambda: not Path(f"/proc/{victim['server_pid']}").exists(), 30), (
        "the killed replica's server went with it"
    )
