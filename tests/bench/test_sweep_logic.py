"""Sweep arithmetic (medians, speedups, paired ratios), its table and its plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest

from slotserve.bench.plots import write_plots
from slotserve.bench.read_floor import bytes_per_token
from slotserve.bench.sweep import _markdown, _summarize, add_sweep_arguments


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    return parser.parse_args(["--slots", "1", "4", "--rounds", "3", *extra])


_THROUGHPUT = {
    "slotserve": {1: [100.0, 90.0, 110.0], 4: [200.0, 150.0, 210.0]},
    "llama-server": {1: [100.0, 100.0, 100.0], 4: [190.0, 200.0, 200.0]},
}


def _result() -> dict:  # type: ignore[type-arg]
    ceiling = {1: [120.0, 110.0, 100.0], 4: [210.0, 200.0, 220.0]}
    samples = {"slotserve": {"ttft_ms": [10.0, 20.0], "itl_ms": [5.0, 6.0, 7.0]}}
    return _summarize(
        _args(), ["slotserve", "llama-server"], _THROUGHPUT, ceiling, [300.0], [], 4, samples
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


def test_sweep_holds_one_stream_tpot_against_the_read_floor() -> None:
    def one_stream(server: str, rate: float, share: float) -> dict[str, object]:
        return {"server": server, "slots": 1, "read_rate_gb_s": rate, "share_of_read_floor": share}

    reports = [
        one_stream("slotserve", 30.0, 0.9),
        one_stream("slotserve", 50.0, 0.7),
        {"server": "slotserve", "slots": 4},  # the floor is one stream's
        one_stream("llama-server", 40.0, 0.6),
        one_stream("llama-server", 45.0, 0.5),
        {"server": "vllm-cpu", "slots": 1},  # reads its own bfloat16 weights, not the file
    ]
    servers = ["slotserve", "llama-server", "vllm-cpu"]
    throughput = {**_THROUGHPUT, "vllm-cpu": _THROUGHPUT["llama-server"]}
    result = _summarize(_args(), servers, throughput, {}, [], reports, 4, {})
    assert result["share_of_read_floor"] == {
        "slotserve": pytest.approx(0.8),
        "llama-server": pytest.approx(0.55),
    }
    assert "at the 30-50 GB/s measured beside each run): slotserve 80%, llama-server 55%." in (
        _markdown(result)
    )


def test_a_token_reads_every_tensor_but_an_untied_embedding(
    model_path: Path, tmp_path: Path
) -> None:
    from slotserve.runners.pytorch.load.gguf_header import GgufHeader

    tied = sum(t.data.nbytes for t in GgufHeader(model_path).tensors)
    assert bytes_per_token(model_path) == tied  # the LM head reads the embedding
    path = tmp_path / "untied.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.add_tensor("output.weight", np.ones((8, 4), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert bytes_per_token(path) == 8 * 4 * 4 + 4 * 4
    assert bytes_per_token(tmp_path) is None
