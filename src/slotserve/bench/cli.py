"""``slotserve bench``: benchmark any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from rich.console import Console

from slotserve.bench.datasets import Conversation, background_dataset
from slotserve.bench.loadgen import LoadConfig, LoadOptions
from slotserve.bench.report import Targets, render_table
from slotserve.bench.runner import DATASETS, build_dataset, run_benchmark


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload flags shared by ``bench`` and ``bench sweep``."""
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", type=Path, help="ShareGPT-format JSON file")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=64,
        help="conversations to send (multi-turn: each has --turns requests)",
    )
    parser.add_argument("--input-len", type=int, default=32, help="prompt words (≈ tokens)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths vary uniformly by ± this fraction",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=1000,
        help="shared-prefix: words in the common system prompt",
    )
    parser.add_argument("--turns", type=int, default=3, help="multi-turn: turns per chat")
    agent = parser.add_argument_group(
        "agent dataset",
        "coding-agent conversations: every turn resends a shared system-and-tools prefix and "
        "the conversation's history; --input-len words a user turn, --max-tokens a reply",
    )
    agent.add_argument(
        "--agent-conversations",
        type=int,
        default=4,
        help="conversations, all run at once (bench sweep: as many as it sends requests)",
    )
    agent.add_argument("--agent-turns", type=int, default=6, help="turns per conversation")
    agent.add_argument(
        "--agent-prefix-len",
        type=int,
        default=6000,
        help="length of the shared prefix in words and punctuation runs (≈ tokens)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let outputs end at EOS (default: exactly --max-tokens)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests first")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 URL"
    )
    parser.add_argument("--model", help="model id (default: the first of /v1/models)")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second, capped by --concurrency (default: all at once)",
    )
    parser.add_argument("--duration", type=float, help="send for this many seconds instead")
    add_workload_arguments(parser)
    parser.add_argument(
        "--agent-background",
        type=int,
        metavar="N",
        help="agent: N streams of unrelated random prompts (--input-len, --max-tokens) for the "
        "whole run, reported apart (default: --concurrency minus --agent-conversations)",
    )
    parser.add_argument("--server-pid", type=int, help="local server process, for its RSS")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--no-progress", action="store_true")
    # Each target's dest is its Targets field.
    targets = parser.add_argument_group("targets (missed: exit status 1)")
    targets.add_argument("--expect-min-output-tps", dest="min_output_tps", type=float)
    targets.add_argument(
        "--expect-speedup-vs",
        dest="speedup_baseline",
        type=Path,
        metavar="FILE.json",
        help="a previous result whose output throughput must be beaten",
    )
    targets.add_argument("--expect-min-speedup", dest="min_speedup", type=float, default=1.0)
    targets.add_argument("--expect-max-p99-ttft-ms", dest="max_p99_ttft_ms", type=float)
    targets.add_argument("--expect-max-failed", dest="max_failed", type=int)
    targets.add_argument("--no-isolation-check", dest="isolation", action="store_false")


def dataset_from_args(args: argparse.Namespace, num: int) -> list[Conversation]:
    """The workload the flags of ``add_workload_arguments`` describe, ``num`` conversations."""
    return build_dataset(
        args.dataset,
        num,
        args.input_len,
        args.max_tokens,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        turns=args.turns,
        path=args.dataset_path,
        seed=args.seed,
        agent_prefix_len=args.agent_prefix_len,
        agent_turns=args.agent_turns,
    )


def background_from_args(args: argparse.Namespace) -> tuple[list[Conversation], int]:
    """The agent dataset's background prompts and how many streams send them."""
    if args.dataset != "agent":
        return [], 0
    streams = args.agent_background
    if streams is None:
        # The agent's conversations plus the background fill the slots when --concurrency
        # matches the server's.
        streams = max(0, args.concurrency - args.agent_conversations)
    # Enough distinct prompts that a stream rarely resends one while the agent runs.
    num = max(16, 8 * streams)
    return background_dataset(num, args.input_len, args.max_tokens, args.seed), streams


def load_options(args: argparse.Namespace) -> LoadOptions:
    """How the flags of ``add_workload_arguments`` send the requests."""
    return {
        "endpoint": args.endpoint,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
    }


def api_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def main_bench(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        num = args.agent_conversations if args.dataset == "agent" else args.num_requests
        conversations = dataset_from_args(args, num)
        background, streams = background_from_args(args)
    except (ValueError, OSError) as exc:
        console.print(f"[red]slotserve bench: {exc}")
        return 2
    config = LoadConfig(
        base_url=api_url(args.base_url),
        model=args.model,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        duration_s=args.duration,
        api_key=args.api_key,
        **load_options(args),
    )
    report = run_benchmark(
        config,
        conversations,
        warmup=args.warmup,
        server_pid=args.server_pid,
        show_progress=not args.no_progress,
        label=f"{args.dataset} ×{args.concurrency}",
        background=background,
        background_streams=streams,
        recheck_isolation=args.isolation,
    )
    render_table(report, f"slotserve bench: {config.base_url}", Console())
    for failure in report["isolation_failures"]:
        console.print(f"[red]isolation: prompts {failure['prompt_ids']} returned the same text")
    for group in report["isolation_reproduced_alone"]:
        console.print(
            f"[dim]isolation: prompts {group['prompt_ids']} returned the same text, and again "
            "each sent alone: the model's own answer"
        )
    for error in report["errors"]:
        console.print(f"[yellow]error: {error}")
    targets = Targets(**{field.name: getattr(args, field.name) for field in fields(Targets)})
    misses = targets.missed(report)
    report["targets_missed"] = misses
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    for miss in misses:
        console.print(f"[red]target missed: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="slotserve bench")
    add_bench_arguments(parser)
    sys.exit(main_bench(parser.parse_args()))
