"""PNG plots of a sweep: throughput against concurrency, and latency distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt


def throughput_plot(
    table: dict[str, dict[int, float]], ceiling: dict[int, float] | None, path: Path, title: str
) -> None:
    """``table[server][concurrency] = median output tok/s``."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server, points in table.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=server)
    if ceiling:
        xs = sorted(ceiling)
        ax.plot(
            xs,
            [ceiling[x] for x in xs],
            linestyle="--",
            color="grey",
            label="raw llama_decode (ceiling)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for p in table.values() for x in p}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent clients (= slots)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_plot(samples: dict[str, dict[str, list[float]]], path: Path, title: str) -> None:
    """``samples[server] = {"ttft_ms": [...], "itl_ms": [...]}``: empirical CDFs."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        for server, data in samples.items():
            values = sorted(data.get(key, []))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, ys, label=server)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples ≤ x")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    table = {
        s: {int(k): v for k, v in points.items()}
        for s, points in result["median_output_throughput"].items()
    }
    ceiling = {int(k): v for k, v in result.get("raw_decode_tps", {}).items()} or None
    paths = [out_dir / "throughput_vs_concurrency.png", out_dir / "latency_distributions.png"]
    throughput_plot(table, ceiling, paths[0], f"Output throughput\n{result['workload']}")
    concurrency = result["latency_samples_at"]
    latency_plot(
        result["latency_samples"],
        paths[1],
        f"Latency distributions at {concurrency} concurrent clients",
    )
    return paths
