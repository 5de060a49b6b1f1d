"""``slotserve bench runners``: the PyTorch runner against the llama.cpp runner through the
server, against HF transformers' own batched ``generate`` and, with ``--peers``, against vLLM's
CPU backend, on the same weights, at several concurrencies.

Per round, each server is started once (slots, or vLLM's ``--max-num-seqs``, = the largest
concurrency) and serves every concurrency in turn: ``--requests-per-client`` requests per
concurrent client, fixed-length greedy output (``ignore_eos``), completions of random prompts.
transformers runs in its own process per batch size, with the batch as the concurrency
(left-padded prompts). Figures are medians over rounds; ratios are medians of per-round paired
ratios. Every served run is also written on its own to ``runs/`` as a vLLM-style result.
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
from slotserve.bench.runner import run_benchmark, write_run_json
from slotserve.bench.servers import (
    ServerSpec,
    add_output_dir_argument,
    resolve_model_or_report,
    running,
    slotserve_spec,
)
from slotserve.bench.vllm_peer import (
    VLLM_PEERS,
    VllmPeer,
    add_vllm_arguments,
    hf_folder_for,
    prepare_vllm,
)

RUNNERS = ("torch", "llama.cpp")


def add_runners_ab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument(
        "--hf-folder",
        type=Path,
        help="the same weights as an HF folder for transformers and vLLM (default: the GGUF "
        "converted once into .peers/hf/)",
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
        "--peers",
        nargs="*",
        choices=VLLM_PEERS,
        default=[],
        help="other servers on the HF folder (skipped with a note when not installed)",
    )
    add_vllm_arguments(parser, hf_folder=False)
    add_output_dir_argument(parser, "runners")


def main_runners_ab(args: argparse.Namespace) -> int:
    console = Console()
    model = resolve_model_or_report(args.model, console)
    if model is None:
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    vllm = prepare_vllm(args.peers, model, args, console)
    hf_folder = hf_folder_for(model, args.hf_folder) if args.hf else None
    servers = [*RUNNERS, *(args.peers if vllm is not None else [])]
    runs: list[dict[str, Any]] = []
    slots = max(levels)
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else list(reversed(servers))
        for name in order:
            spec = _spec(name, model, slots, args, vllm)
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
                        label=f"round {round_index + 1} {name} ×{level}",
                    )
                    write_run_json(
                        report, out_dir / "runs" / f"{name}-x{level}-r{round_index}.json"
                    )
                    runs.append(_run(round_index, name, level, report))
                    console.print(
                        f"round {round_index + 1} {name:>16} ×{level:<3} "
                        f"{report['output_throughput']:7.1f} tok/s  failed {report['failed']}"
                    )
        if hf_folder is not None:
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


def _spec(
    name: str, model: Path, slots: int, args: argparse.Namespace, vllm: VllmPeer | None
) -> ServerSpec:
    if name in VLLM_PEERS:
        assert vllm is not None
        return vllm.spec(name, slots, args.threads, args.ctx_per_slot)
    extra = ["--runner", name, "--max-queue", "4096"]
    if name == "torch":
        extra += ["--max-model-len", str(args.ctx_per_slot), *args.torch_args.split()]
    return slotserve_spec(model, slots, args.threads, args.ctx_per_slot, extra)


def _run(round_index: int, name: str, level: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One row of ``runs``: which server, round and concurrency, then the run's flat metrics
    (vLLM's keys; transformers' rows have only its throughput)."""
    flat = {k: v for k, v in metrics.items() if k not in ("samples", "config")}
    return {
        **flat,
        "round": round_index,
        "runner": name,
        "concurrency": level,
        "output_throughput": float(metrics["output_throughput"]),
        "failed": int(metrics.get("failed", 0)),
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
    ratios = result["ratios"]
    ratio_names = [k for k in ratios if k.startswith("torch_vs_")]
    for column in ("concurrency", *names, *(f"torch ÷ {k[9:]}" for k in ratio_names)):
        table.add_column(column)
    for level in result["workload"]["concurrency"]:
        key = str(level)
        table.add_row(
            key,
            *(f"{result['medians'][n][key]:.1f}" for n in names),
            *(f"{ratios[k][key]:.2f}" for k in ratio_names),
        )
    console.print(table)
