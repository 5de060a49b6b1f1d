"""Sweep arithmetic (medians, speedups, paired ratios), its table and its plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from slotserve.bench.plots import write_plots
from slotserve.bench.sweep import _markdown, _summarize, add_sweep_arguments


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    return parser.parse_args(["--slots", "1", "4", "--rounds", "3", *extra])


def _result() -> dict:  # type: ignore[type-arg]
    throughput = {
        "slotserve": {1: [100.0, 90.0, 110.0], 4: [200.0, 150.0, 210.0]},
        "llama-server": {1: [100.0, 100.0, 100.0], 4: [190.0, 200.0, 200.0]},
    }
    ceiling = {1: [120.0, 110.0, 100.0], 4: [210.0, 200.0, 220.0]}
    samples = {"slotserve": {"ttft_ms": [10.0, 20.0], "itl_ms": [5.0, 6.0, 7.0]}}
    return _summarize(
        _args(), ["slotserve", "llama-server"], throughput, ceiling, [300.0], [], 4, samples
    )


def test_sweep_reports_medians_speedups_and_paired_ratios() -> None:
    result = _result()
    assert result["median_output_throughput"]["slotserve"] == {1: 100.0, 4: 200.0}
    assert result["speedup_over_first"]["slotserve"][4] == pytest.approx(2.0)
    # Per-round ratios at 4 slots: 200/190, 150/200, 210/200 -> median 1.05.
    assert result["slotserve_over_peer_paired_median"]["llama-server"][4] == pytest.approx(1.05)
    assert result["slotserve_over_raw_decode"][1] == pytest.approx(100 / 110)
    table = _markdown(result)
    assert "| 4 | 200.0 | 200.0 | 2.00 | 2.00 | 1.05 | 210.0 | 0.95 |" in table
    assert "slotserve ÷ llama-server" in table


def test_sweep_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(_result(), tmp_path)
    assert [p.name for p in paths] == ["throughput_vs_concurrency.png", "latency_distributions.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
