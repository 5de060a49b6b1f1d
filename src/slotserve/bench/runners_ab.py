"""``slotserve bench runners``: the PyTorch runner against the llama.cpp runner through the
server, and against HF transformers' own batched ``generate``, on the same weights, at several
concurrencies (SPEC R2, B2).

Per round, each server is started once (slots = the largest concurrency) and serves every
concurrency in turn: ``--requests-per-client`` requests per concurrent client, fixed-length
greedy output (``ignore_eos``), completions of random prompts. transformers runs in its own
process per batch size, with the batch as the concurrency (left-padded prompts). Figures are
medians over rounds; ratios are medians of per-round paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slotserve.bench.datasets import random_dataset
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark
from slotserve.bench.servers import resolve_model_or_report, running, slotserve_spec

RUNNERS = ("torch", "llama.cpp")


def add_runners_ab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument(
        "--hf-folder",
        type=Path,
        help="the same weights as an HF folder for transformers (default: converted from "
        "the GGUF into the output directory)",
    )
    parser.add_argument("--concurrency", default="1,4,8,16,64", help="comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=32, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    parser.add_argument("--torch-args", default="", help="extra flags for the torch server")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("benchmarks/results") / time.strftime("runners-%Y%m%d-%H%M%S"),
    )


def main_runners_ab(args: argparse.Namespace) -> int:
    console = Console()
    model = resolve_model_or_report(args.model, console)
    if model is None:
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_folder = args.hf_folder
    if args.hf and hf_folder is None:
        from slotserve.bench.hf_reference import convert_gguf_to_hf

        hf_folder = convert_gguf_to_hf(model, out_dir / "hf-model")
    runs: list[dict[str, Any]] = []
    slots = max(levels)
    for round_index in range(args.rounds):
        order = list(RUNNERS) if round_index % 2 == 0 else list(reversed(RUNNERS))
        for runner in order:
            extra = ["--runner", runner, "--max-queue", "4096"]
            if runner == "torch":
                extra += ["--max-model-len", str(args.ctx_per_slot), *args.torch_args.split()]
            spec = slotserve_spec(model, slots, args.threads, args.ctx_per_slot, extra)
            with running(spec, out_dir / "logs") as server:
                for level in levels:
                    dataset = random_dataset(
                        level * args.requests_per_client, args.input_len, args.max_tokens,
                        seed=round_index * 1000 + level,
                    )  # fmt: skip
                    config = LoadConfig(
                        base_url=server.api_url, endpoint="completions", concurrency=level
                    )
                    report = run_benchmark(
                        config,
                        dataset,
                        warmup=min(level, 4),
                        server_pid=server.pid,
                        label=f"round {round_index + 1} {runner} ×{level}",
                    )
                    summary = report["summary"]
                    runs.append(_run(round_index, runner, level, summary))
                    console.print(
                        f"round {round_index + 1} {runner:>9} ×{level:<3} "
                        f"{summary['output_throughput']:7.1f} tok/s  failed {summary['failed']}"
                    )
        if args.hf and hf_folder is not None:
            for level in levels:
                result = _hf_run(hf_folder, level, args, round_index)
                runs.append(_run(round_index, "transformers", level, result))
                console.print(
                    f"round {round_index + 1} transformers ×{level:<3} "
                    f"{result['output_throughput']:7.1f} tok/s"
                )
    result = _summarize(args, levels, runs)
    (out_dir / "runners.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "runners.md").write_text(_markdown(result) + "\n")
    _print_table(result, console)
    console.print(f"results: {out_dir / 'runners.json'}, {out_dir / 'runners.md'}")
    return 0


def _run(round_index: int, name: str, level: int, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "round": round_index,
        "runner": name,
        "concurrency": level,
        "output_throughput": float(summary["output_throughput"]),
        "failed": int(summary.get("failed", 0)),
        "summary": summary,
    }


def _hf_run(folder: Path, level: int, args: argparse.Namespace, round_index: int) -> dict[str, Any]:
    prompts = [c.prompt(0) for c in random_dataset(level, args.input_len, 1, seed=round_index)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(prompts, handle)
    command = [
        sys.executable, "-m", "slotserve.bench.hf_reference", str(folder),
        "--batch", str(level), "--prompts", handle.name, "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    Path(handle.name).unlink()
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _summarize(
    args: argparse.Namespace, levels: list[int], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    names = sorted({r["runner"] for r in runs}, key=lambda n: (n != "torch", n))

    def series(name: str, level: int) -> list[float]:
        chosen = [r for r in runs if r["runner"] == name and r["concurrency"] == level]
        return [r["output_throughput"] for r in sorted(chosen, key=lambda r: r["round"])]

    medians = {
        name: {str(level): statistics.median(series(name, level)) for level in levels}
        for name in names
    }
    ratios: dict[str, dict[str, float]] = {}
    for other in names:
        if other == "torch":
            continue
        ratios[f"torch_vs_{other}"] = {
            str(level): statistics.median(
                t / o for t, o in zip(series("torch", level), series(other, level), strict=True)
            )
            for level in levels
        }
    base = levels[0]
    ratios["torch_scaling_vs_own_first_level"] = {
        str(level): statistics.median(
            t / b for t, b in zip(series("torch", level), series("torch", base), strict=True)
        )
        for level in levels
    }
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count()},
        "workload": {
            "concurrency": levels,
            "requests_per_client": args.requests_per_client,
            "prompt_words": args.input_len,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "medians": medians,
        "ratios": ratios,
        "runs": runs,
    }


def _markdown(result: dict[str, Any]) -> str:
    w, medians, ratios = result["workload"], result["medians"], result["ratios"]
    names = list(medians)
    header = " | ".join(f"{n} tok/s" for n in names)
    ratio_names = [k for k in ratios if k.startswith("torch_vs_")]
    lines = [
        f"Output tok/s, completions of ~{w['prompt_words']}-word prompts, {w['max_tokens']} "
        f"greedy tokens each, {w['requests_per_client']} requests per client, medians of "
        f"{w['rounds']} rounds, {w['threads']} threads.",
        "",
        f"| concurrency | {header} | "
        + " | ".join(k.replace("_", " ") for k in ratio_names)
        + " | torch ÷ its ×1 |",
        "|---" * (2 + len(names) + len(ratio_names)) + "|",
    ]
    for level in w["concurrency"]:
        key = str(level)
        row = [key, *(f"{medians[n][key]:.1f}" for n in names)]
        row += [f"{ratios[k][key]:.2f}" for k in ratio_names]
        row.append(f"{ratios['torch_scaling_vs_own_first_level'][key]:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title="runners: output tok/s")
    names = list(result["medians"])
    for column in ("concurrency", *names, "torch ÷ llama.cpp", "torch ÷ transformers"):
        table.add_column(column)
    ratios = result["ratios"]
    for level in result["workload"]["concurrency"]:
        key = str(level)
        table.add_row(
            key,
            *(f"{result['medians'][n][key]:.1f}" for n in names),
            f"{ratios['torch_vs_llama.cpp'][key]:.2f}" if "torch_vs_llama.cpp" in ratios else "-",
            (
                f"{ratios['torch_vs_transformers'][key]:.2f}"
                if "torch_vs_transformers" in ratios
                else "-"
            ),
        )
    console.print(table)
