"""Arithmetic of ``slotserve bench prefix-cache`` (the servers themselves run in the sweep's
and the bench's end-to-end tests)."""

from __future__ import annotations

from slotserve.bench.prefix_ab import _markdown, _summarize
from slotserve.cli import build_prefix_ab_parser


def _run(round_index: int, config: str, ttft_ms: float, tps: float) -> dict[str, object]:
    # Runs are flat: the run's metrics (vLLM's keys) beside its round and configuration.
    return {
        "round": round_index,
        "config": config,
        "median_ttft_ms": ttft_ms,
        "p90_ttft_ms": ttft_ms * 2,
        "output_throughput": tps,
        "failed": 0,
    }


def test_ratios_are_medians_of_paired_rounds() -> None:
    args = build_prefix_ab_parser().parse_args(["--rounds", "2", "--users", "4"])
    runs = [
        _run(0, "off", 40_000, 10.0),
        _run(0, "on", 8_000, 40.0),
        _run(1, "off", 30_000, 12.0),
        _run(1, "on", 10_000, 36.0),
    ]
    result = _summarize(args, ["off", "on"], runs)
    assert result["ratios"]["on"]["ttft_p50_speedup_vs_off"] == (5.0 + 3.0) / 2
    assert result["ratios"]["on"]["throughput_vs_off"] == (4.0 + 3.0) / 2
    assert result["medians"]["off"]["median_ttft_ms"] == 35_000
    assert result["workload"]["users"] == 4 and result["workload"]["requests"] == 4
    table = _markdown(result)
    assert "| on | 9000 | 18000 | 38.0 | 4.00 | 3.50 |" in table


def test_peers_and_a_request_count_apart_from_the_concurrency() -> None:
    parser = build_prefix_ab_parser()
    args = parser.parse_args(
        ["--users", "16", "--requests", "32", "--peers", "vllm-cpu", "vllm-cpu-default"]
    )
    assert args.requests == 32 and args.users == 16
    assert args.peers == ["vllm-cpu", "vllm-cpu-default"] and args.peer
    assert parser.parse_args([]).peers == ["llama-server"]
    assert parser.parse_args([]).requests is None
