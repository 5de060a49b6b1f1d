"""``slotserve bench``: benchmark any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from rich.console import Console

from slotserve.bench.datasets import Conversation
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
    )


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
        conversations = dataset_from_args(args, args.num_requests)
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
    )
    render_table(report, f"slotserve bench: {config.base_url}", Console())
    for failure in report["isolation_failures"]:
        console.print(f"[red]isolation: prompts {failure['prompt_ids']} returned the same text")
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
