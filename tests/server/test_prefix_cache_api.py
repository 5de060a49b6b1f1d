"""The prefix cache seen from the API: ``cached_tokens`` in usage, ``/v1/prefix_cache_stats``,
multi-turn hits, and the switch that turns it off; on the llama.cpp runner, whose hits leave
whole grains to compute, and the disk tier on both runners."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

SYSTEM = "You are a patient tutor. " + " ".join(
    f"Guideline {i}: explain step {i} plainly, check understanding, and keep it short."
    for i in range(12)
)
MODEL = "SmolLM2-135M-Instruct.Q4_1"
GRAIN = 64  # a cache hit leaves whole grains of prompt to compute (scheduler invariant 8)


def _stats(server: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{server.base_url}/v1/prefix_cache_stats", timeout=10).json())


def _chat(messages: list[ChatCompletionMessageParam]) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}, *messages]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("server"), "--runner", "llama.cpp", "--slots", "8")
    yield proc
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_identical_requests_back_to_back_report_cached_tokens(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    before = _stats(server)
    # A system prompt no other test sends: its first sight must miss whatever ran before.
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Back-to-back check. " + SYSTEM},
        {"role": "user", "content": "What is a fraction?"},
    ]
    replies = [
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, seed=1
        )
        for _ in range(4)
    ]
    cached = []
    for reply in replies:
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
    assert replies[0].usage is not None
    prompt_tokens = replies[0].usage.prompt_tokens
    assert cached[0] == 0, "a first sight of this prompt misses"
    assert cached[1:] == [prompt_tokens - GRAIN] * 3 and cached[1] > 0
    assert len({r.choices[0].message.content for r in replies}) == 1
    after = _stats(server)
    assert after["hits"] - before["hits"] >= 3
    assert after["hit_tokens"] - before["hit_tokens"] >= sum(cached[1:])


def test_streaming_usage_carries_cached_tokens(client: openai.OpenAI) -> None:
    messages = _chat([{"role": "user", "content": "Name three prime numbers."}])
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    final = [chunk for chunk in stream if chunk.usage is not None]
    assert len(final) == 1 and final[0].usage is not None
    details = final[0].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= GRAIN


def test_a_chat_turn_reuses_the_history_before_it(client: openai.OpenAI) -> None:
    history = _chat([{"role": "user", "content": "Explain what a denominator is."}])
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24)
    assert first.usage is not None
    first_prompt = first.usage.prompt_tokens
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And a numerator?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # The earlier prompt comes from the cache, less what rounds the rest to whole grains; the
    # reply itself is recomputed.
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert (second.usage.prompt_tokens - cached) % GRAIN == 0  # whole grains are computed
    assert first_prompt - GRAIN - 1 <= cached <= first_prompt


def test_stats_endpoint_reports_every_figure_and_a_clean_integrity_check(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    checks_before = _stats(server)["integrity_checks"]
    for _ in range(2):  # the second hits what the first cached
        client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2)
    stats = _stats(server)
    for key in (
        "enabled",
        "hits",
        "misses",
        "hit_rate",
        "query_tokens",
        "hit_tokens",
        "average_hit_tokens",
        "cached_tokens",
        "cached_bytes",
        "nodes",
        "evictions",
        "budget_tokens",
        "budget_bytes",
    ):
        assert key in stats, key
    assert stats["enabled"] is True and stats["disabled_reason"] is None
    assert stats["cached_tokens"] > 0 and stats["cached_bytes"] > stats["cached_tokens"]
    assert 0 < stats["hit_rate"] <= 1 and stats["nodes"] >= 1
    # The engine checks KV bookkeeping each time it goes idle.
    assert wait_until(lambda: _stats(server)["integrity_checks"] > checks_before)
    assert _stats(server)["integrity_failures"] == 0


@pytest.fixture(scope="module")
def uncached_server(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("uncached"),
        *("--runner", "llama.cpp", "--slots", "2"),
        env={"SLOTSERVE_PREFIX_CACHE": "0"},
    )
    yield proc
    stop_server(proc)


def test_cache_can_be_switched_off(uncached_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=uncached_server.api_url, api_key="unused", max_retries=0)
    for _ in range(2):
        reply = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    stats = _stats(uncached_server)
    assert stats["enabled"] is False and "--no-prefix-cache" in stats["disabled_reason"]
    assert stats["hits"] == 0


def test_a_busy_servers_prefix_comes_back_from_host_ram(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> None:
    busy = start_server(
        tmp_path_factory.mktemp("host-ram"),
        *("--runner", "llama.cpp", "--slots", "2", "--prefix-cache-ram", "256MiB"),
    )
    try:
        client = openai.OpenAI(base_url=busy.api_url, api_key="unused", max_retries=0)
        agent = _chat([{"role": "user", "content": "Which step comes first?"}])

        prompt_tokens: list[tuple[int, int]] = []  # (prompt, cached) of every request

        def ask(messages: list[ChatCompletionMessageParam]) -> tuple[str, int]:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0
            )
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            prompt_tokens.append((usage.prompt_tokens, cached))
            return reply.choices[0].message.content or "", cached

        first, _ = ask(agent)
        with ThreadPoolExecutor(2) as pool:  # two other prompts at once take both slots
            others = [[{"role": "user", "content": f"Tell me about {t}. " * 40}] for t in "ab"]
            list(pool.map(ask, others))
        again, cached = ask(agent)
        assert again == first and cached > 0
        stats = _stats(busy)
        tiers = stats["tiers"]
        assert tiers["host_ram"]["hits"] == 1 and tiers["host_ram"]["hit_tokens"] == cached
        assert 0 < tiers["host_ram"]["bytes"] <= tiers["host_ram"]["budget_bytes"] == 256 << 20
        # Restore against recompute: what the restored tokens would have cost at the rate the
        # computed prompt tokens ran.
        computed = sum(prompt - hit for prompt, hit in prompt_tokens)
        assert stats["computed_tokens"] == computed and stats["compute_seconds"] > 0
        rate = stats["compute_seconds"] / computed
        assert stats["compute_seconds_per_token"] == pytest.approx(rate)
        host = tiers["host_ram"]
        assert host["restore_seconds"] > 0
        assert host["recompute_seconds_estimate"] == pytest.approx(cached * rate)
        text = httpx.get(f"{busy.base_url}/metrics", timeout=10).text
        assert f'slotserve:prefix_cache_host_restores_total{{model_name="{MODEL}"}} 1.0' in text
        tier = (
            f'slotserve:prefix_cache_tier_hit_tokens_total{{model_name="{MODEL}",tier="host_ram"}}'
        )
        assert f"{tier} {float(cached)}" in text
        label = f'{{model_name="{MODEL}"}}'
        assert f"slotserve:prompt_computed_tokens_total{label} {float(computed)}" in text
        assert f"slotserve:prompt_compute_seconds_total{label} " in text
    finally:
        stop_server(busy)


@pytest.mark.parametrize("runner", ["llama.cpp", "torch"])
def test_a_restart_on_the_same_prefix_cache_dir_serves_the_prompt_from_disk(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, runner: str
) -> None:
    folder = tmp_path_factory.mktemp("kv-states")
    (folder / "left-by-someone.kvstate").write_bytes(b"garbage")  # ignored, never a crash
    messages = _chat([{"role": "user", "content": "Which step comes last?"}])

    def serve_once() -> tuple[str, int, dict[str, Any]]:
        server = start_server(
            tmp_path_factory.mktemp("restart"),
            *("--runner", runner, "--slots", "2", "--prefix-cache-dir", str(folder)),
        )
        try:
            client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached = reply.usage.prompt_tokens_details.cached_tokens or 0
            return reply.choices[0].message.content or "", cached, _stats(server)["tiers"]
        finally:
            stop_server(server)  # a graceful stop writes the cached prefixes to the folder

    first, cold, _ = serve_once()
    assert cold == 0
    again, cached, tiers = serve_once()
    assert again == first and cached > 0
    assert tiers["disk"]["hits"] == 1 and tiers["disk"]["hit_tokens"] == cached
    assert tiers["disk"]["bad_files"] >= 1
