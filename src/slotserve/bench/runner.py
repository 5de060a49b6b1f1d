"""One benchmark run: workload in, report dict out (used by ``slotserve bench`` and sweeps).

The report is flat like the JSON ``vllm bench serve --save-result`` writes (``completed``,
``output_throughput``, ``mean_ttft_ms``, ``max_concurrency``... at the top level), so tools that
read vLLM's results read ours; our own keys (``config``, ``isolation_failures``,
``isolation_reproduced_alone``, ``errors``, ``server_memory``, ``samples``) sit beside them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from slotserve.bench.datasets import (
    Conversation,
    agent_dataset,
    edit_dataset,
    multi_turn_dataset,
    open_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from slotserve.bench.loadgen import LoadConfig, resend_alone, resolve_model_sync, run_load
from slotserve.bench.metrics import (
    describe_isolation,
    isolation_failures,
    reproduced_alone,
    summarize,
    turn_summary,
)
from slotserve.bench.report import rss_bytes
from slotserve.bench.servers import ServerSpec, running

# Requests of flagged isolation groups sent again alone, at most: a bound on the recheck's time.
MAX_RESENT = 64
DATASETS = ("random", "shared-prefix", "multi-turn", "agent", "sharegpt", "edit", "open")


def build_dataset(
    name: str,
    num: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 1000,
    turns: int = 3,
    path: Path | None = None,
    seed: int = 0,
    agent_prefix_len: int = 6000,
    agent_turns: int = 6,
) -> list[Conversation]:
    if name == "random":
        return random_dataset(num, input_len, output_len, range_ratio, seed)
    if name == "shared-prefix":
        return shared_prefix_dataset(num, prefix_len, input_len, output_len, seed)
    if name == "multi-turn":
        return multi_turn_dataset(num, turns, input_len, output_len, seed)
    if name == "agent":
        return agent_dataset(num, agent_turns, agent_prefix_len, input_len, output_len, seed)
    if name == "edit":
        return edit_dataset(num, output_len, seed)
    if name == "open":
        return open_dataset(num, output_len, seed)
    if name == "sharegpt":
        if path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        return sharegpt_dataset(path, num, output_len, seed)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def run_benchmark(
    config: LoadConfig,
    conversations: list[Conversation],
    *,
    warmup: int = 0,
    server_pid: int | None = None,
    show_progress: bool = True,
    label: str = "",
    background: list[Conversation] | None = None,
    background_streams: int = 0,
    recheck_isolation: bool = True,
) -> dict[str, Any]:
    """Runs the load and returns the flat report: vLLM's result keys, then ours.

    Conversations of several turns add ``turn_summary``'s keys. ``background_streams``
    concurrent streams of ``background`` prompts run beside the load; their results are
    summarized apart, under ``background``, and join the others only in the isolation check and
    the errors. With ``recheck_isolation``, the requests of every group the isolation check
    flags are sent again one at a time (at most ``MAX_RESENT``): a group whose every request
    returns the same text by itself is the model's own answer, listed under
    ``isolation_reproduced_alone`` instead of ``isolation_failures``.
    """
    if config.model is None:
        # vLLM's results name the model; ask the server once instead of inside the load.
        config = replace(config, model=resolve_model_sync(config))
    total = sum(len(c.user_turns) for c in conversations) if config.duration_s is None else None
    rss_before = rss_bytes(server_pid) if server_pid else None
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not show_progress,
        transient=True,
    ) as progress:
        task = progress.add_task(label or "requests", total=total)
        run = asyncio.run(
            run_load(
                config,
                conversations,
                warmup,
                on_result=lambda _: progress.advance(task),
                background=background or [],
                background_streams=background_streams,
            )
        )
    rss_after = rss_bytes(server_pid) if server_pid else None
    results = run.results
    flagged = isolation_failures(results + run.background)
    reproduced = []
    if flagged and recheck_isolation:
        members = [r.prompt_id for group in flagged for r in group][:MAX_RESENT]
        alone = asyncio.run(resend_alone(config, run, members))
        own_answer = [reproduced_alone(group, alone) for group in flagged]
        reproduced = [group for group, own in zip(flagged, own_answer, strict=True) if own]
        flagged = [group for group, own in zip(flagged, own_answer, strict=True) if not own]
    multi_turn = any(len(c.user_turns) > 1 for c in conversations)
    extra: dict[str, Any] = turn_summary(results) if multi_turn else {}
    if background_streams and background:
        extra["background"] = {
            "streams": background_streams,
            **summarize(run.background, run.duration),
        }
    return {
        **vllm_header(config, label, total if total is not None else len(results)),
        **summarize(results, run.duration),
        **extra,
        "config": {
            **asdict(config),
            "num_conversations": len(conversations),
            "warmup": warmup,
            "background_streams": background_streams if background else 0,
            "request_rate": None if config.request_rate == float("inf") else config.request_rate,
        },
        "isolation_failures": [describe_isolation(group) for group in flagged],
        "isolation_reproduced_alone": [describe_isolation(group) for group in reproduced],
        "errors": sorted({r.error for r in results + run.background if r.error})[:20],
        "server_memory": {"rss_before_bytes": rss_before, "rss_after_bytes": rss_after},
        # Per-request samples, for latency distribution plots.
        "samples": {
            "ttft_ms": [r.ttft * 1000 for r in results if r.success],
            "itl_ms": [gap * 1000 for r in results if r.success for gap in r.itl],
        },
    }


def random_completions_on(
    spec: ServerSpec,
    concurrency: int,
    requests_per_client: int,
    input_len: int,
    max_tokens: int,
    seed: int,
    log_dir: Path,
) -> dict[str, Any]:
    """Starts ``spec`` alone for one run: ``concurrency`` clients each send
    ``requests_per_client`` completions of random ``input_len``-word prompts for ``max_tokens``
    greedy tokens (``ignore_eos``). The report; a failed request raises."""
    conversations = random_dataset(
        concurrency * requests_per_client, input_len, max_tokens, 0.0, seed
    )
    with running(spec, log_dir) as server:
        config = LoadConfig(
            base_url=server.api_url, endpoint="completions", concurrency=concurrency
        )
        report = run_benchmark(
            config, conversations, warmup=2, server_pid=server.pid, show_progress=False
        )
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report.get('errors')}")
    return report


def vllm_header(config: LoadConfig, label: str, num_prompts: int) -> dict[str, Any]:
    """The run description ``vllm bench serve`` puts before its metrics, under its names."""
    backend = "openai-chat" if config.endpoint == "chat" else "openai"
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),  # vLLM's format
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": config.model,
        "tokenizer_id": config.model,  # the server tokenizes; the client never loads one
        "num_prompts": num_prompts,
        "request_rate": "inf" if config.request_rate == float("inf") else config.request_rate,
        "burstiness": 1.0,  # Poisson arrivals, as vLLM's default
        "max_concurrency": config.concurrency,
        "request_goodput": None,  # no goodput targets are set
    }


def write_run_json(report: dict[str, Any], path: Path) -> None:
    """One run's report as its own file (without the per-request samples), readable as a
    ``vllm bench serve`` result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {k: v for k, v in report.items() if k != "samples"}
    path.write_text(json.dumps(flat, indent=2) + "\n")
