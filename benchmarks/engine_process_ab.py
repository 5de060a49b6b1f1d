"""Engine-core process vs engine thread, through the server.

For each round and concurrency, starts one server with ``--engine-process`` and one with
``--no-engine-process`` (alternating which goes first), each alone on the machine, and runs the
same random workload against it: 64-word prompts, ``--max-tokens`` greedy tokens with
``ignore_eos``, ``--requests-per-client`` requests per client. Prints output tok/s and TPOT
medians and the median of the per-round ratios process ÷ thread.

    python benchmarks/engine_process_ab.py --runner llama.cpp --concurrency 1 16 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from slotserve.bench.ab import alternate
from slotserve.bench.runner import random_completions_on
from slotserve.bench.servers import slotserve_spec
from slotserve.hosting.source import embedded_model_path

MODES = {"process": "--engine-process", "thread": "--no-engine-process"}


def one_run(args: argparse.Namespace, mode: str, concurrency: int, seed: int) -> dict[str, Any]:
    extra = [MODES[mode], "--runner", args.runner, *args.server_args.split()]
    spec = slotserve_spec(embedded_model_path(), max(args.concurrency), args.threads, 512, extra)
    return random_completions_on(
        spec, concurrency, args.requests_per_client, args.input_len, args.max_tokens, seed,
        args.log_dir,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runner", choices=["llama.cpp", "torch"], default="llama.cpp")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-args", default="", help="more slotserve serve flags")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/logs"))
    args = parser.parse_args()
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            order = alternate(list(MODES), round_index)
            for mode in order:
                report = one_run(args, mode, concurrency, seed=round_index)
                rows.setdefault((mode, concurrency), []).append(report)
                print(
                    f"round {round_index + 1} c={concurrency:>3} {mode:>7}: "
                    f"{report['output_throughput']:7.1f} tok/s  "
                    f"TPOT p50 {report['median_tpot_ms']:6.1f} ms",
                    flush=True,
                )
    summary = []
    for concurrency in args.concurrency:
        process, thread = rows[("process", concurrency)], rows[("thread", concurrency)]
        ratios = [
            p["output_throughput"] / t["output_throughput"]
            for p, t in zip(process, thread, strict=True)
        ]
        entry = {
            "concurrency": concurrency,
            "process_tok_s": statistics.median(r["output_throughput"] for r in process),
            "thread_tok_s": statistics.median(r["output_throughput"] for r in thread),
            "process_tpot_ms": statistics.median(r["median_tpot_ms"] for r in process),
            "thread_tpot_ms": statistics.median(r["median_tpot_ms"] for r in thread),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
        }
        summary.append(entry)
        print(json.dumps(entry))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(
            json.dumps({"args": vars(args), "summary": summary}, indent=2, default=str)
        )


if __name__ == "__main__":
    main()
