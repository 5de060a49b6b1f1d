"""Scale-out: 8 distinct ~1k-token system prompts × 8 users each, through (a) one server,
(b) 2 Ray Serve replicas with prefix-aware routing, (c) 2 replicas round-robin, (d) the SGLang
Model Gateway (sglang-router, cache_aware) over 2 workers.

Per system: prefix hit rate (repeated-prefix requests whose cached_tokens cover >= 90% of the
system prompt; and cached / prompt tokens over all requests), TTFT p50/p90, throughput. Each
system runs alone on the machine; rounds alternate the order. On a 2-core box the replicas
share the cores: the single server gets both threads and the KV of two (16 slots), each
replica or worker one thread and 8 slots.

    python benchmarks/scale_out.py [--rounds 2] [--out benchmarks/results/scale_out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from slotserve.bench.ab import alternate
from slotserve.bench.metrics import percentile
from slotserve.bench.servers import ServerSpec, free_port, running
from slotserve.hosting.source import resolve_model_path

PREFIXES, USERS, CONCURRENCY, MAX_TOKENS = 8, 8, 8, 16
SERVE = [sys.executable, "-m", "slotserve.cli", "serve"]
LOGS = Path("benchmarks/results/scale_out_logs")
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def system_prompts(seed: int = 0) -> list[str]:
    """Eight distinct system prompts of about 1k tokens (random English words)."""
    words = (  # noqa: SIM905 (a sentence of words reads better than a column of them)
        "policy customer order refund shipping account invoice warranty product support "
        "escalate verify identity address payment delivery return damaged replace discount "
        "subscription cancel renew schedule technician install manual battery screen update"
    ).split()
    rng = random.Random(seed)
    return [
        f"You are support agent {i} of company {i}. Follow these rules strictly. "
        + " ".join(rng.choice(words) for _ in range(900))
        for i in range(PREFIXES)
    ]


def workload() -> list[tuple[int, dict[str, Any]]]:
    """(prefix index, chat body) in a seeded random arrival order (a fixed cycle of 8 prefixes
    would hand round-robin the same replica for each prefix every time)."""
    prompts = system_prompts()
    jobs = []
    for user in range(USERS):
        for prefix, system in enumerate(prompts):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"User {user} asks: where is order {user * 97}?"},
            ]
            jobs.append((prefix, {"messages": messages}))
    random.Random(1).shuffle(jobs)
    return jobs


async def _one(client: httpx.AsyncClient, model: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {
        **body,
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        replica = response.headers.get("x-replica-id", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": ttft,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "replica": replica,
    }


async def run_workload(api_url: str) -> dict[str, Any]:
    jobs = workload()
    async with httpx.AsyncClient(base_url=api_url, timeout=600) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        limit = asyncio.Semaphore(CONCURRENCY)

        async def limited(body: dict[str, Any]) -> dict[str, Any]:
            async with limit:
                return await _one(client, model, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(body) for _, body in jobs))
        elapsed = time.perf_counter() - started
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"{len(errors)} errors, e.g. {errors[0]}", flush=True)
    ok = [(prefix, r) for (prefix, _), r in zip(jobs, results, strict=True) if "error" not in r]
    first_seen: set[int] = set()
    repeated, hits = 0, 0
    system_tokens = min(r["prompt_tokens"] for _, r in ok) - 40  # the user turn: < 40 tokens
    for prefix, result in ok:
        if prefix in first_seen:
            repeated += 1
            hits += result["cached_tokens"] >= 0.9 * system_tokens
        first_seen.add(prefix)
    ttfts = [r["ttft"] for _, r in ok if r["ttft"] is not None]
    return {
        "requests": len(jobs),
        "errors": len(errors),
        "repeated_prefix_hit_rate": hits / repeated if repeated else 0.0,
        "cached_token_share": sum(r["cached_tokens"] for _, r in ok)
        / max(1, sum(r["prompt_tokens"] for _, r in ok)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": sum(r["output_tokens"] for _, r in ok) / elapsed,
        "seconds": elapsed,
        "replicas_used": len({r["replica"] for _, r in ok if r["replica"]}),
    }


def _server(name: str, args: list[str], env: dict[str, str] | None = None) -> ServerSpec:
    port = free_port()
    return ServerSpec(name, [*SERVE, *args, "--port", str(port)], port, "/ready", env or {})


@contextmanager
def system(name: str, model: Path) -> Iterator[str]:
    """The system ``name`` running alone; yields its OpenAI base URL."""
    # 8 slots of 2k tokens per replica or worker; the single server has as much as two.
    common = [str(model), "--slots", "8", "--ctx-size", "16384"]
    if name == "one server":
        single = [str(model), "--slots", "16", "--ctx-size", "32768", "--threads", "2"]
        with running(_server(name, single), LOGS) as server:
            yield server.api_url
        return
    if name.startswith("2 replicas"):
        routing = "prefix" if "prefix" in name else "round-robin"
        replicas = [*common, "--threads", "1", "--replicas", "2", "--replica-cpus", "1"]
        spec = _server(name, [*replicas, "--replica-routing", routing], RAY_ENV)
        with running(spec, LOGS) as server:
            yield server.api_url
        return
    workers = [_server(f"worker{i}", [*common, "--threads", "1"]) for i in range(2)]
    with running(workers[0], LOGS) as first, running(workers[1], LOGS) as second:
        port = free_port()
        router = ServerSpec(
            "sglang-router",
            [
                *(sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware"),
                *("--worker-urls", first.spec.base_url, second.spec.base_url),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            port,
            "/v1/models",
        )
        with running(router, LOGS) as gateway:
            yield gateway.api_url


SYSTEMS = [
    "one server",
    "2 replicas, prefix-aware",
    "2 replicas, round-robin",
    "sglang-router cache_aware, 2 workers",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale_out.json"))
    args = parser.parse_args()
    model = resolve_model_path(None)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    for round_index in range(args.rounds):
        order = alternate(SYSTEMS, round_index)
        for name in order:
            with system(name, model) as api_url:
                result = asyncio.run(run_workload(api_url))
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: {json.dumps(result)}", flush=True)
    summary = {
        name: {
            key: statistics.median(run[key] for run in results)
            for key in results[0]
            if isinstance(results[0][key], int | float)
        }
        for name, results in runs.items()
    }
    report = {
        "machine": f"{os.cpu_count()} cores, CPU only; every system alone on it",
        "model": model.name,
        "workload": f"{PREFIXES} system prompts (~1k tokens) x {USERS} users, "
        f"{CONCURRENCY} in flight, {MAX_TOKENS} output tokens, greedy",
        "rounds": args.rounds,
        "median": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, row in summary.items():
        print(
            f"{name:40s} hits {row['repeated_prefix_hit_rate']:.0%}  "
            f"cached {row['cached_token_share']:.0%}  TTFT p50 {row['ttft_p50_s']:.3f} s  "
            f"p90 {row['ttft_p90_s']:.3f} s  {row['requests_per_s']:.2f} req/s  "
            f"{row['output_tokens_per_s']:.1f} tok/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
