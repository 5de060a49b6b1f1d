"""``slotserve bench prefix-cache``: many users sharing one long system prompt, served with the
prefix cache on and off (and by the peers: llama-server when built, vLLM with ``--peers``),
alternately for several rounds.

Configurations, each on a freshly started server:

* ``off``: slotserve with ``--no-prefix-cache``: every prompt is computed in full.
* ``on``: slotserve with the cache, cold: the first request of the run computes the system
  prompt, the others reuse it (those arriving with it wait for it instead of computing it again).
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
from typing import Any

import httpx
from rich.table import Table

from slotserve.bench import ab
from slotserve.bench.datasets import Conversation, shared_prefix_dataset
from slotserve.bench.vllm_peer import VLLM_PEERS

CONFIGS = ("off", "on", "on-warm")
PEERS = ("llama-server", *VLLM_PEERS)
MEDIANS = ("median_ttft_ms", "p90_ttft_ms", "output_throughput", "failed")


def add_prefix_ab_arguments(parser: argparse.ArgumentParser) -> None:
    ab.add_model_argument(parser)
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
    ab.add_round_arguments(parser, rounds=2, ctx_per_slot=2048)
    ab.add_peer_arguments(
        parser,
        PEERS,
        ["llama-server"],
        "peers on the same workload (skipped with a note when not installed)",
    )
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip every peer")
    parser.add_argument(
        "--server-args",
        default="",
        help="more flags for every slotserve configuration ('--runner torch')",
    )
    ab.add_output_dir_argument(parser, "prefix-cache")


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
    return ab.run(_prefix_cache, args)


def _prefix_cache(session: ab.Session, args: argparse.Namespace) -> int:
    servers = session.servers(args.peers if args.peer else [], args)
    names = [*CONFIGS, *servers.peers]
    requests = args.requests or args.users
    runs: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for name in ab.alternate(names, round_index):
            # A fresh system prompt per round; the same one for every configuration in it.
            dataset = shared_prefix_dataset(
                requests, args.prefix_len, args.input_len, args.max_tokens, seed=round_index
            )
            spec = servers.spec(name, args.slots, _config_args(name, args))
            with session.start(spec) as server:
                if name == "on-warm":
                    _warm(server.api_url, dataset[0])
                report = session.measure(
                    server,
                    dataset,
                    concurrency=args.users,
                    warmup=2,
                    ignore_eos=True,
                    label=f"round {round_index + 1} {name}",
                )
                stats = _prefix_stats(server.spec.base_url) if name in CONFIGS else None
            session.write_run(report, f"{name}-r{round_index}")
            run = {"round": round_index, "config": name, "prefix_cache_stats": stats}
            runs.append({**ab.metrics_of(report), **run})
            session.console.print(
                f"round {round_index + 1} {name:>16}: TTFT p50 {report['median_ttft_ms']:8.0f} ms"
                f"  p90 {report['p90_ttft_ms']:8.0f} ms  {report['output_throughput']:6.1f} "
                f"tok/s  failed {report['failed']}"
            )
    result = _summarize(args, names, runs)
    return session.finish("prefix_cache", result, _markdown(result), _table(result))


def _config_args(name: str, args: argparse.Namespace) -> list[str]:
    """The slotserve flags of configuration ``name``."""
    cache = ["--no-prefix-cache"] if name == "off" else []
    return [*cache, *args.server_args.split()]


def _summarize(
    args: argparse.Namespace, names: list[str], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    medians = {
        name: {key: ab.median(ab.series(runs, key, config=name)) for key in MEDIANS}
        for name in names
    }
    off_ttft = ab.series(runs, "median_ttft_ms", config="off")
    off_tps = ab.series(runs, "output_throughput", config="off")
    ratios = {
        name: {
            "ttft_p50_speedup_vs_off": ab.paired_median(
                off_ttft, ab.series(runs, "median_ttft_ms", config=name)
            ),
            "throughput_vs_off": ab.paired_median(
                ab.series(runs, "output_throughput", config=name), off_tps
            ),
        }
        for name in names
        if name != "off"
    }
    workload = {
        "users": args.users,
        "requests": args.requests or args.users,
        "slots": args.slots,
        "system_prompt_words": args.prefix_len,
        "user_words": args.input_len,
        "max_tokens": args.max_tokens,
    }
    return ab.summary(args, workload, medians=medians, ratios=ratios, runs=runs)


def _rows(result: dict[str, Any], off: str) -> list[list[str]]:
    """A row per configuration; ``off``: its ratios, which are to itself."""
    rows = []
    for name, m in result["medians"].items():
        ratio = result["ratios"].get(name)
        rows.append(
            [
                name,
                f"{m['median_ttft_ms']:.0f}",
                f"{m['p90_ttft_ms']:.0f}",
                f"{m['output_throughput']:.1f}",
                f"{ratio['ttft_p50_speedup_vs_off']:.2f}" if ratio else off,
                f"{ratio['throughput_vs_off']:.2f}" if ratio else off,
            ]
        )
    return rows


def _markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    columns = ["config", "TTFT p50 ms", "TTFT p90 ms", "output tok/s"]
    columns += ["TTFT p50 × faster than off", "throughput ÷ off"]
    caption = (
        f"{w['users']} concurrent users, {w.get('requests', w['users'])} requests, "
        f"{w['slots']} slots, a ~{w['system_prompt_words']}-word "
        f"shared system prompt, {w['max_tokens']} output tokens, medians of {w['rounds']} rounds."
    )
    return ab.markdown_table(columns, _rows(result, off="1.00"), caption)


def _table(result: dict[str, Any]) -> Table:
    columns = ("config", "TTFT p50 ms", "TTFT p90 ms", "tok/s", "TTFT ×", "tok/s ÷ off")
    return ab.rich_table("prefix cache on vs off", columns, _rows(result, off="-"))
