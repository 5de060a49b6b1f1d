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
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table

from slotserve.bench import ab
from slotserve.bench.datasets import random_dataset
from slotserve.bench.vllm_peer import VLLM_PEERS, hf_folder_for

RUNNERS = ("torch", "llama.cpp")


def add_runners_ab_arguments(parser: argparse.ArgumentParser) -> None:
    ab.add_model_argument(parser)
    parser.add_argument(
        "--hf-folder",
        type=Path,
        help="the same weights as an HF folder for transformers and vLLM (default: the GGUF "
        "converted once into .peers/hf/)",
    )
    ab.add_concurrency_argument(parser, "1,4,8,16,64")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=32, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=64)
    ab.add_round_arguments(parser, rounds=1, ctx_per_slot=512)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    parser.add_argument("--torch-args", default="", help="extra flags for the torch server")
    ab.add_peer_arguments(
        parser,
        VLLM_PEERS,
        [],
        "other servers on the HF folder (skipped with a note when not installed)",
        hf_folder=False,
    )
    ab.add_output_dir_argument(parser, "runners")


def main_runners_ab(args: argparse.Namespace) -> int:
    return ab.run(_runners, args)


def _runners(session: ab.Session, args: argparse.Namespace) -> int:
    levels = ab.concurrency_levels(args)
    servers = session.servers(args.peers, args)
    hf_folder = hf_folder_for(session.model, args.hf_folder) if args.hf else None
    runs: list[dict[str, Any]] = []
    slots = max(levels)
    for round_index in range(args.rounds):
        for name in ab.alternate([*RUNNERS, *servers.peers], round_index):
            with session.start(servers.spec(name, slots, _runner_args(name, args))) as server:
                for level in levels:
                    dataset = random_dataset(
                        level * args.requests_per_client, args.input_len, args.max_tokens,
                        seed=round_index * 1000 + level,
                    )  # fmt: skip
                    report = session.measure(
                        server,
                        dataset,
                        concurrency=level,
                        warmup=min(level, 4),
                        label=f"round {round_index + 1} {name} ×{level}",
                        endpoint="completions",
                    )
                    session.write_run(report, f"{name}-x{level}-r{round_index}")
                    runs.append(_run(round_index, name, level, report))
                    session.console.print(
                        f"round {round_index + 1} {name:>16} ×{level:<3} "
                        f"{report['output_throughput']:7.1f} tok/s  failed {report['failed']}"
                    )
        if hf_folder is not None:
            for level in levels:
                result = _hf_run(hf_folder, level, args, round_index)
                runs.append(_run(round_index, "transformers", level, result))
                session.console.print(
                    f"round {round_index + 1} transformers ×{level:<3} "
                    f"{result['output_throughput']:7.1f} tok/s"
                )
    result = _summarize(args, levels, runs)
    return session.finish("runners", result, _markdown(result), _table(result))


def _runner_args(name: str, args: argparse.Namespace) -> list[str]:
    """The slotserve flags that serve with runner ``name``."""
    extra = ["--runner", name, "--max-queue", "4096"]
    if name == "torch":
        extra += ["--max-model-len", str(args.ctx_per_slot), *args.torch_args.split()]
    return extra


def _run(round_index: int, name: str, level: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One row of ``runs``: which server, round and concurrency, then the run's flat metrics
    (vLLM's keys; transformers' rows have only its throughput)."""
    return {
        **ab.metrics_of(metrics),
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

    def tps(name: str, level: int) -> list[float]:
        return ab.series(runs, "output_throughput", runner=name, concurrency=level)

    medians = {
        name: {str(level): ab.median(tps(name, level)) for level in levels} for name in names
    }
    ratios = {
        f"torch_vs_{other}": {
            str(level): ab.paired_median(tps("torch", level), tps(other, level)) for level in levels
        }
        for other in names
        if other != "torch"
    }
    ratios["torch_scaling_vs_own_first_level"] = {
        str(level): ab.paired_median(tps("torch", level), tps("torch", levels[0]))
        for level in levels
    }
    workload = {
        "concurrency": levels,
        "requests_per_client": args.requests_per_client,
        "prompt_words": args.input_len,
        "max_tokens": args.max_tokens,
    }
    return ab.summary(args, workload, medians=medians, ratios=ratios, runs=runs)


def _ratio_names(result: dict[str, Any]) -> list[str]:
    return [k for k in result["ratios"] if k.startswith("torch_vs_")]


def _rows(result: dict[str, Any], scaling: bool) -> list[list[str]]:
    """A row per concurrency: tok/s per server, then torch ÷ each (``scaling``: then torch ÷
    its own first concurrency)."""
    medians, ratios = result["medians"], result["ratios"]
    rows = []
    for level in result["workload"]["concurrency"]:
        key = str(level)
        row = [key, *(f"{m[key]:.1f}" for m in medians.values())]
        row += [f"{ratios[k][key]:.2f}" for k in _ratio_names(result)]
        if scaling:
            row.append(f"{ratios['torch_scaling_vs_own_first_level'][key]:.2f}")
        rows.append(row)
    return rows


def _markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    columns = ["concurrency", *(f"{n} tok/s" for n in result["medians"])]
    columns += [k.replace("_", " ") for k in _ratio_names(result)] + ["torch ÷ its ×1"]
    caption = (
        f"Output tok/s, completions of ~{w['prompt_words']}-word prompts, {w['max_tokens']} "
        f"greedy tokens each, {w['requests_per_client']} requests per client, medians of "
        f"{w['rounds']} rounds, {w['threads']} threads."
    )
    return ab.markdown_table(columns, _rows(result, scaling=True), caption)


def _table(result: dict[str, Any]) -> Table:
    columns = ["concurrency", *result["medians"]]
    columns += [f"torch ÷ {k.removeprefix('torch_vs_')}" for k in _ratio_names(result)]
    return ab.rich_table("runners: output tok/s", columns, _rows(result, scaling=False))
