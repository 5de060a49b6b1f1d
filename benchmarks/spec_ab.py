"""Speculative decoding (n-gram prompt lookup) on vs off, through the server (issue 16).

Per runner, one server with ``--speculative-config`` and one without (alternating which goes
first), each alone on the machine; against each, two chat workloads at each concurrency:
**grounded** (the bench's random prompts, which ask the model to repeat ~64 given words, so
its answer copies its input) and **open** (open-ended questions, nothing to copy). Greedy,
``--max-tokens`` tokens. Prints output tok/s and the ratio on ÷ off per workload and
concurrency, and writes every run's report to ``--output``.

    python benchmarks/spec_ab.py --runners torch llama.cpp --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slotserve.bench.datasets import Conversation, random_dataset
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark
from slotserve.bench.servers import running, slotserve_spec
from slotserve.model_source import embedded_model_path

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": %d, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2%s}'
)
TOPICS = (
    "why the sky is blue",
    "how bread rises",
    "what a compiler does",
    "the life of a bee",
    "how tides work",
    "why we sleep",
    "how a bicycle stays up",
    "what causes rain",
    "how vaccines work",
    "the history of paper",
    "how magnets work",
    "why leaves change colour",
    "how a refrigerator cools",
    "what a black hole is",
    "how birds navigate",
    "how soap cleans",
)


def open_dataset(num: int, max_tokens: int) -> list[Conversation]:
    return [
        Conversation(
            f"open-{i}", [f"Explain {TOPICS[i % len(TOPICS)]} in a few paragraphs."], max_tokens
        )
        for i in range(num)
    ]


def one_run(
    args: argparse.Namespace, runner: str, spec_on: bool, workload: str, concurrency: int
) -> dict[str, Any]:
    extra = ["--runner", runner]
    if spec_on:
        limit = f', "disable_by_batch_size": {args.disable_by_batch_size}'
        if args.min_acceptance_rate is not None:
            limit += f', "min_acceptance_rate": {args.min_acceptance_rate}'
        extra += ["--speculative-config", SPEC % (args.k, limit)]
    spec = slotserve_spec(embedded_model_path(), max(args.concurrency), args.threads, 1024, extra)
    num = concurrency * args.requests_per_client
    conversations = (
        random_dataset(num, 64, args.max_tokens, 0.0, seed=concurrency)
        if workload == "grounded"
        else open_dataset(num, args.max_tokens)
    )
    with running(spec, args.log_dir) as server:
        config = LoadConfig(base_url=server.api_url, endpoint="chat", concurrency=concurrency)
        report = run_benchmark(
            config, conversations, warmup=1, server_pid=server.pid, show_progress=False
        )
    assert report["failed"] == 0, report.get("errors")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runners", nargs="+", default=["torch", "llama.cpp"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", default=["grounded", "open"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--disable-by-batch-size", type=int, default=2)
    parser.add_argument(
        "--min-acceptance-rate", type=float, help="default: the server's (0.2, or per runner)"
    )
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/logs"))
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for runner in args.runners:
        for workload in args.workloads:
            for concurrency in args.concurrency:
                tok_s = {}
                order = (True, False) if len(runs) % 2 == 0 else (False, True)
                for spec_on in order:
                    report = one_run(args, runner, spec_on, workload, concurrency)
                    tok_s[spec_on] = report["output_throughput"]
                    runs.append(
                        {
                            "runner": runner,
                            "workload": workload,
                            "concurrency": concurrency,
                            "speculation": spec_on,
                            "report": report,
                        }
                    )
                print(
                    f"{runner:9} {workload:8} x{concurrency:<3} off {tok_s[False]:7.1f} "
                    f"on {tok_s[True]:7.1f} tok/s  on÷off {tok_s[True] / tok_s[False]:.2f}",
                    flush=True,
                )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
