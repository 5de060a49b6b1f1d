"""Soak test (marked ``soak``): a long mixed load against a real spawned server.

At least 1,000 requests at concurrency 16: chat and text completions, streaming and not, n of
1-2, stop strings, seeds; 30% of clients disconnect at a random point (before the first token,
mid-stream, or while a non-streaming request runs) and 10% send malformed requests. Afterwards
the server must hold nothing: no busy slot, no queued request, KV usage back to idle (0) and
a clean KV integrity check; every valid request completed or was cleanly aborted; no 5xx at
all; the server healthy and serving. ``SLOTSERVE_SOAK_REQUESTS`` and
``SLOTSERVE_SOAK_CONCURRENCY`` change the size; the figures are printed and written to
``soak.json`` in the test's directory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

pytestmark = pytest.mark.soak

NUM_REQUESTS = int(os.environ.get("SLOTSERVE_SOAK_REQUESTS", "1000"))
CONCURRENCY = int(os.environ.get("SLOTSERVE_SOAK_CONCURRENCY", "16"))
SLOTS = 16
MODEL = "SmolLM2-135M-Instruct.Q4_1"

TOPICS = ["the sea", "a red fox", "batching", "tea", "mountains", "a lost key", "robots", "rain"]
# Shared by a third of the chat requests: long enough (~200 tokens) for the prefix cache to
# reuse, so its bookkeeping is soaked under disconnects too.
SYSTEM = (
    "You are a patient assistant for a small library. You answer in one or two short "
    "sentences, you never invent facts, and when you do not know you say so plainly. "
) * 4

MALFORMED: list[tuple[str, str, Any]] = [
    ("invalid JSON", "completions", b'{"prompt": "hi", '),
    ("wrong type", "chat/completions", {"messages": "hello"}),
    ("unknown field", "completions", {"prompt": "hi", "frobnicate": 1}),
    ("negative max_tokens", "completions", {"prompt": "hi", "max_tokens": -3}),
    ("over the context", "completions", {"prompt": "hi", "max_tokens": 10**6}),
    ("unknown model", "completions", {"model": "gpt-17", "prompt": "hi"}),
    (
        "bad logit_bias",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 1e9}},
    ),
    ("n above the slots", "completions", {"prompt": "hi", "n": 99}),
    ("empty messages", "chat/completions", {"messages": []}),
    ("prompt ids outside the vocabulary", "completions", {"prompt": [1, 2, 10**9]}),
    ("empty body", "chat/completions", b""),
    ("stream not a bool", "completions", {"prompt": "hi", "stream": "yes"}),
]


@dataclass
class Tally:
    sent: int = 0
    valid: int = 0
    completed: int = 0
    disconnects: dict[str, int] = field(default_factory=lambda: collections.Counter())
    malformed: int = 0
    statuses: dict[int, int] = field(default_factory=lambda: collections.Counter())
    server_errors: list[str] = field(default_factory=list)
    bad_completions: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("soak"),
        "--slots",
        str(SLOTS),
        "--ctx-size",
        str(SLOTS * 512),
        "--max-queue",
        "512",
        "--log-level",
        "warning",
    )
    yield proc
    stop_server(proc)


def _valid_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(TOPICS)
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 32),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randint(0, 1000),
        "n": rng.choice([1, 1, 1, 2]),
    }
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"Write a few words about {topic}."}]
        if rng.random() < 0.35:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        return "chat/completions", {**body, "messages": messages}
    return "completions", {**body, "prompt": f"A short note about {topic}:" * rng.randint(1, 4)}


async def _send(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    roll = rng.random()
    if roll < 0.10:
        name, route, body = rng.choice(MALFORMED)
        tally.malformed += 1
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = await http.post(f"/v1/{route}", **kwargs)
        _record(tally, response.status_code, f"malformed ({name})")
        if not 400 <= response.status_code < 500:
            tally.bad_completions.append(f"malformed ({name}) got {response.status_code}")
        return
    route, body = _valid_body(rng)
    tally.valid += 1
    disconnect = roll < 0.40  # 30% of all requests
    if not disconnect:
        await _complete(http, rng, route, body, tally)
        return
    how = rng.choice(["before the first token", "mid-stream", "non-streaming"])
    tally.disconnects[how] += 1
    body["max_tokens"] = 64  # long enough to still be running when the client leaves
    if how == "non-streaming":
        with contextlib.suppress(TimeoutError):  # the client gave up: a disconnect
            response = await asyncio.wait_for(
                http.post(f"/v1/{route}", json=body), timeout=rng.uniform(0.0, 0.6)
            )
            _record(tally, response.status_code, "non-streaming disconnect (finished first)")
        return
    async with http.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as response:
        _record(tally, response.status_code, f"disconnect {how}")
        if how == "mid-stream":
            to_read = rng.randint(1, 12)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    to_read -= 1
                    if to_read == 0:
                        break
        # Leaving the block closes the connection: the server must abort and free the slot.


async def _complete(
    http: httpx.AsyncClient, rng: random.Random, route: str, body: dict[str, Any], tally: Tally
) -> None:
    stream = rng.random() < 0.5
    n = body["n"]
    if not stream:
        response = await http.post(f"/v1/{route}", json=body)
        _record(tally, response.status_code, f"valid {route}")
        if response.status_code != 200:
            tally.bad_completions.append(f"{route} got {response.status_code}: {response.text}")
            return
        reply = response.json()
        finish = [c["finish_reason"] for c in reply["choices"]]
        if len(finish) != n or not set(finish) <= {"stop", "length"}:
            tally.bad_completions.append(f"{route} finish reasons {finish}")
            return
        if reply["usage"]["completion_tokens"] < n:
            tally.bad_completions.append(f"{route} usage {reply['usage']}")
            return
        tally.completed += 1
        return
    reasons: dict[int, str] = {}
    done = False
    async with http.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as response:
        _record(tally, response.status_code, f"valid streaming {route}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    tally.bad_completions.append(f"stream error event {event}")
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        reasons[choice["index"]] = choice["finish_reason"]
    if response.status_code != 200 or not done or len(reasons) != n:
        tally.bad_completions.append(f"stream {route}: done={done} reasons={reasons}")
    elif not set(reasons.values()) <= {"stop", "length"}:
        tally.bad_completions.append(f"stream {route}: reasons {reasons}")
    else:
        tally.completed += 1


def _record(tally: Tally, status: int, what: str) -> None:
    tally.statuses[status] += 1
    if status >= 500:
        tally.server_errors.append(f"{what}: {status}")


async def _load(base_url: str, tally: Tally) -> None:
    rng = random.Random(20261123)
    seeds = [rng.random() for _ in range(NUM_REQUESTS)]
    queue: asyncio.Queue[float] = asyncio.Queue()
    for seed in seeds:
        queue.put_nowait(seed)
    limits = httpx.Limits(max_connections=CONCURRENCY + 4, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                seed = queue.get_nowait()
                tally.sent += 1
                await _send(http, random.Random(seed), tally)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def test_soak(soak_server: ServerProcess, tmp_path: Path) -> None:
    base = soak_server.base_url
    tally = Tally()
    started = time.monotonic()
    asyncio.run(_load(base, tally))
    duration = time.monotonic() - started

    # Every disconnect frees its slot within a step; give the last ones a moment to land.
    def idle() -> bool:
        slots = soak_server.slots()
        return slots["num_waiting"] == 0 and all(s["state"] == "free" for s in slots["slots"])

    assert wait_until(idle, timeout=60), soak_server.slots()
    checks_at_idle = httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_checks"]
    stats = soak_server.slots()
    cache = httpx.get(f"{base}/v1/prefix_cache_stats").json()
    summary = {
        "requests": tally.sent,
        "concurrency": CONCURRENCY,
        "valid": tally.valid,
        "completed": tally.completed,
        "disconnects": dict(tally.disconnects),
        "malformed": tally.malformed,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors_5xx": len(tally.server_errors),
        "engine_submitted": stats["requests_submitted"],
        "engine_finished": stats["requests_finished"],
        "engine_aborted": stats["requests_aborted"],
        "engine_failed": stats["requests_failed"],
        "busy_slots_after": sum(1 for s in stats["slots"] if s["state"] != "free"),
        "kv_cache_usage_after": _metric(base, "vllm:kv_cache_usage_perc"),
        "integrity_checks": cache["integrity_checks"],
        "integrity_failures": cache["integrity_failures"],
        "prefix_cache_hit_rate": cache["hit_rate"],
        "duration_s": round(duration, 1),
    }
    (tmp_path / "soak.json").write_text(json.dumps(summary, indent=2))
    print("\nsoak:", json.dumps(summary))  # the figures for the closing note

    assert tally.sent >= NUM_REQUESTS
    assert tally.server_errors == [], tally.server_errors[:5]
    assert tally.bad_completions == [], tally.bad_completions[:5]
    assert tally.completed == tally.valid - sum(tally.disconnects.values())
    # Every request the engine took either finished or was cleanly aborted; none failed.
    assert stats["requests_failed"] == 0
    assert stats["requests_submitted"] == stats["requests_finished"] + stats["requests_aborted"]
    assert stats["requests_aborted"] > 0, "the disconnects reached the engine"
    assert summary["busy_slots_after"] == 0
    assert summary["kv_cache_usage_after"] == 0.0
    assert _metric(base, "vllm:num_requests_running") == 0
    assert cache["integrity_failures"] == 0 and checks_at_idle > 0
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    after = httpx.post(f"{base}/v1/completions", json={"prompt": "Still there?", "max_tokens": 3})
    assert after.status_code == 200
    # The idle-time integrity check ran again after this request, and was clean.
    assert wait_until(
        lambda: (
            httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_checks"] > checks_at_idle
        )
    )
    assert httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_failures"] == 0
