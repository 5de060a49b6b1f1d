"""Thread binding and the allocator, through the server: the PyTorch runner as it starts by
default, with its OpenMP threads bound to cores (``OMP_PROC_BIND=close OMP_PLACES=cores``, as
vLLM binds its own), and with tcmalloc preloaded (``LD_PRELOAD``, as vLLM's CPU images do).

For each round and concurrency, one server per setting (the order rotating with the round),
each alone on the machine, runs the same random workload: 64-word prompts, ``--max-tokens``
greedy tokens with ``ignore_eos``, ``--requests-per-client`` requests per client. Prints output
tok/s and the median of the per-round ratios setting ÷ default.

    python benchmarks/threads_ab.py --concurrency 16 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from slotserve.bench.runner import random_completions_on
from slotserve.bench.servers import slotserve_spec
from slotserve.hosting.source import embedded_model_path

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # libtcmalloc-minimal4
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "bound": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "tcmalloc": {"LD_PRELOAD": str(TCMALLOC)},
}


def one_run(args: argparse.Namespace, setting: str, concurrency: int, seed: int) -> dict[str, Any]:
    extra = ["--runner", "torch", "--max-model-len", "512"]
    spec = slotserve_spec(embedded_model_path(), max(args.concurrency), args.threads, 512, extra)
    spec = replace(spec, env=SETTINGS[setting])
    return random_completions_on(
        spec, concurrency, args.requests_per_client, args.input_len, args.max_tokens, seed,
        args.log_dir,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/logs"))
    args = parser.parse_args()
    settings = [s for s in SETTINGS if s != "tcmalloc" or TCMALLOC.exists()]
    rows: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            shift = round_index % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                report = one_run(args, setting, concurrency, seed=round_index)
                rows.setdefault((setting, concurrency), []).append(report["output_throughput"])
                print(
                    f"round {round_index + 1} c={concurrency:>3} {setting:>8}: "
                    f"{report['output_throughput']:7.1f} tok/s",
                    flush=True,
                )
    summary = []
    for concurrency in args.concurrency:
        default = rows[("default", concurrency)]
        for setting in settings:
            runs = rows[(setting, concurrency)]
            ratios = [r / d for r, d in zip(runs, default, strict=True)]
            entry = {
                "concurrency": concurrency,
                "setting": setting,
                "tok_s": runs,
                "ratio_to_default_median": statistics.median(ratios),
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
