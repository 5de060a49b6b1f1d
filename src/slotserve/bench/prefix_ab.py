"""``slotserve bench prefix-cache``: many users sharing one long system prompt, served with the
prefix cache on and off (and by the peers: llama-server when built, vLLM with ``--peers``),
alternately for several rounds.

Configurations, each on a freshly started server:

* ``off``: slotserve with ``--no-prefix-cache``: every prompt is computed in full.
* ``on``: slotserve with the cache, cold: the first request of the run computes the system
  prompt, the others reuse it (those arriving with it wait for it: scheduler invariant 7).
* ``on-warm``: the same after one uncounted request with the system prompt, as on a server
  that has seen it before.
* ``llama-server`` (when built): llama.cpp's server, with its own per-slot prompt cache.
* ``vllm-cpu``, ``vllm-cpu-default`` (``--peers``, when installed): vLLM's CPU backend on the
  same weights as an HF folder, with its automatic prefix caching (on by default).

``--users`` requests run at once out of ``--requests`` in all (default: one each). Each figure
is the median over rounds; ratios are medians of per-round paired ratios. Every run is also
written on its own to ``runs/`` as a vLLM-style result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from slotserve.bench.datasets import Conversation, shared_prefix_dataset
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark, write_run_json
from slotserve.bench.servers import (
    ServerSpec,
    add_output_dir_argument,
    find_llama_server,
    llama_server_spec,
    resolve_model_or_report,
    running,
    slotserve_spec,
)
from slotserve.bench.vllm_peer import VLLM_PEERS, VllmPeer, add_vllm_arguments, prepare_vllm

CONFIGS = ("off", "on", "on-warm")
PEERS = ("llama-server", *VLLM_PEERS)


def add_prefix_ab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--users", type=int, default=16, help="concurrent users")
    parser.add_argument(
        "--requests",
        type=int,
        help="requests in all, each with its own question (default: --users)",
    )
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1000, help="system prompt words")
    parser.add_argument("--input-len", type=int, default=24, help="each user's own words")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ctx-per-slot", type=int, default=2048)
    parser.add_argument(
        "--llama-server", type=Path, default=os.environ.get("SLOTSERVE_LLAMA_SERVER")
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        default=["llama-server"],
        help="peers on the same workload (skipped with a note when not installed)",
    )
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip every peer")
    parser.add_argument(
        "--server-args",
        default="",
        help="more flags for every slotserve configuration ('--runner torch')",
    )
    add_vllm_arguments(parser)
    add_output_dir_argument(parser, "prefix-cache")


def _spec(
    name: str,
    args: argparse.Namespace,
    model: Path,
    binary: Path | None,
    vllm: VllmPeer | None = None,
) -> ServerSpec:
    if name in VLLM_PEERS:
        assert vllm is not None
        return vllm.spec(name, args.slots, args.threads, args.ctx_per_slot)
    if name == "llama-server":
        assert binary is not None
        return llama_server_spec(binary, model, args.slots, args.threads, args.ctx_per_slot)
    extra = ["--no-prefix-cache"] if name == "off" else []
    extra += args.server_args.split()
    return slotserve_spec(model, args.slots, args.threads, args.ctx_per_slot, extra)


def _warm(api_url: str, conversation: Conversation) -> None:
    """One uncounted request that puts the shared system prompt in the cache."""
    messages = [
        {"role": "system", "content": conversation.system or ""},
        {"role": "user", "content": "Warm-up: say hello."},
    ]
    body = {"model": "default", "messages": messages, "max_tokens": 1}
    models = httpx.get(f"{api_url}/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    httpx.post(f"{api_url}/chat/completions", json=body, timeout=600).raise_for_status()


def _prefix_stats(base_url: str) -> dict[str, Any] | None:
    response = httpx.get(f"{base_url}/v1/prefix_cache_stats", timeout=30)
    return dict(response.json()) if response.status_code == 200 else None


def main_prefix_ab(args: argparse.Namespace) -> int:
    console = Console()
    model = resolve_model_or_report(args.model, console)
    if model is None:
        return 2
    peers = args.peers if args.peer else []
    binary = find_llama_server(args.llama_server) if "llama-server" in peers else None
    if "llama-server" in peers and binary is None:
        console.print("[yellow]llama-server not found (benchmarks/build_llama_server.sh); skipped")
    vllm = prepare_vllm(peers, model, args, console)
    names = [*CONFIGS, *(["llama-server"] if binary else [])]
    names += [name for name in peers if name in VLLM_PEERS and vllm is not None]
    requests = args.requests or args.users
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            # A fresh system prompt per round; the same one for every configuration in it.
            dataset = shared_prefix_dataset(
                requests, args.prefix_len, args.input_len, args.max_tokens, seed=round_index
            )
            with running(_spec(name, args, model, binary, vllm), out_dir / "logs") as server:
                if name == "on-warm":
                    _warm(server.api_url, dataset[0])
                config = LoadConfig(
                    base_url=server.api_url, concurrency=args.users, ignore_eos=True
                )
                report = run_benchmark(
                    config,
                    dataset,
                    warmup=2,
                    server_pid=server.pid,
                    label=f"round {round_index + 1} {name}",
                )
                stats = _prefix_stats(server.spec.base_url) if name in CONFIGS else None
            write_run_json(report, out_dir / "runs" / f"{name}-r{round_index}.json")
            # The run's flat metrics; its load config is the workload's, recorded once below.
            metrics = {k: v for k, v in report.items() if k not in ("samples", "config")}
            runs.append(
                {**metrics, "round": round_index, "config": name, "prefix_cache_stats": stats}
            )
            console.print(
                f"round {round_index + 1} {name:>16}: TTFT p50 {report['median_ttft_ms']:8.0f} ms"
                f"  p90 {report['p90_ttft_ms']:8.0f} ms  {report['output_throughput']:6.1f} "
                f"tok/s  failed {report['failed']}"
            )
    result = _summarize(args, names, runs)
    (out_dir / "prefix_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "prefix_cache.md").write_text(_markdown(result) + "\n")
    _print_table(result, console)
    console.print(f"results: {out_dir / 'prefix_cache.json'}, {out_dir / 'prefix_cache.md'}")
    return 0


def _summarize(
    args: argparse.Namespace, names: list[str], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    def series(name: str, key: str) -> list[float]:
        ordered = sorted((r for r in runs if r["config"] == name), key=lambda r: r["round"])
        return [float(r[key]) for r in ordered]

    medians = {
        name: {
            key: statistics.median(series(name, key))
            for key in ("median_ttft_ms", "p90_ttft_ms", "output_throughput", "failed")
        }
        for name in names
    }
    ratios: dict[str, dict[str, float]] = {}
    off_ttft, off_tps = series("off", "median_ttft_ms"), series("off", "output_throughput")
    for name in names:
        if name == "off":
            continue
        ttft, tps = series(name, "median_ttft_ms"), series(name, "output_throughput")
        ratios[name] = {
            "ttft_p50_speedup_vs_off": statistics.median(
                o / t for o, t in zip(off_ttft, ttft, strict=True) if t > 0
            ),
            "throughput_vs_off": statistics.median(
                t / o for o, t in zip(off_tps, tps, strict=True) if o > 0
            ),
        }
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count()},
        "workload": {
            "users": args.users,
            "requests": args.requests or args.users,
            "slots": args.slots,
            "system_prompt_words": args.prefix_len,
            "user_words": args.input_len,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "medians": medians,
        "ratios": ratios,
        "runs": runs,
    }


def _markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [
        f"{w['users']} concurrent users, {w.get('requests', w['users'])} requests, "
        f"{w['slots']} slots, a ~{w['system_prompt_words']}-word "
        f"shared system prompt, {w['max_tokens']} output tokens, medians of {w['rounds']} rounds.",
        "",
        "| config | TTFT p50 ms | TTFT p90 ms | output tok/s | TTFT p50 × faster than off "
        "| throughput ÷ off |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in result["medians"].items():
        ratio = result["ratios"].get(name)
        speedup = f"{ratio['ttft_p50_speedup_vs_off']:.2f}" if ratio else "1.00"
        gain = f"{ratio['throughput_vs_off']:.2f}" if ratio else "1.00"
        lines.append(
            f"| {name} | {m['median_ttft_ms']:.0f} | {m['p90_ttft_ms']:.0f} | "
            f"{m['output_throughput']:.1f} | {speedup} | {gain} |"
        )
    return "\n".join(lines)


def _print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title="prefix cache on vs off")
    for column in ("config", "TTFT p50 ms", "TTFT p90 ms", "tok/s", "TTFT ×", "tok/s ÷ off"):
        table.add_column(column)
    for name, m in result["medians"].items():
        ratio = result["ratios"].get(name)
        table.add_row(
            name,
            f"{m['median_ttft_ms']:.0f}",
            f"{m['p90_ttft_ms']:.0f}",
            f"{m['output_throughput']:.1f}",
            f"{ratio['ttft_p50_speedup_vs_off']:.2f}" if ratio else "-",
            f"{ratio['throughput_vs_off']:.2f}" if ratio else "-",
        )
    console.print(table)
