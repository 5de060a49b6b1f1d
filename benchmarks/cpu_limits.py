"""The box's limits beside what the PyTorch runner's projections reach on them.

Measures, with torch's threads (``--threads``): the memory bandwidth (a float32 sum over a
buffer far larger than the caches), the bfloat16 matmul peak as oneDNN reaches it (a large
square prepacked matmul), and one decode step's projections of the embedded SmolLM2 shapes
(30 layers of distinct weights and the head, prepacked as the runner prepacks them) at 1 and 64
rows: GB/s of weights read at one row, GFLOP/s at 64.

    python benchmarks/cpu_limits.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

REORDER = torch.ops.mkldnn._reorder_linear_weight
LINEAR = torch.ops.mkldnn._linear_pointwise

# SmolLM2-135M: (rows, input) of each layer's projections; down's 1,536-long input is split
# into two 768-long halves by the runner (batch invariance), as here.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 768), (576, 768)]
HEAD = (49152, 576)
LAYERS = 30


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memory_bandwidth() -> float:
    buffer = torch.ones(256 * 2**20, dtype=torch.float32)  # 1 GiB
    return buffer.numel() * 4 / _median_seconds(buffer.sum, 5) / 1e9


def matmul_peak() -> float:
    n = 4096
    weight = REORDER(torch.randn(n, n).bfloat16(), 1)
    x = torch.randn(n, n).bfloat16()
    seconds = _median_seconds(lambda: LINEAR(x, weight, None, "none", [], ""), 5)
    return 2 * n**3 / seconds / 1e12 * 1e3


def projections(rows: int) -> dict[str, float]:
    shapes = LAYER * LAYERS + [HEAD]
    weights = [REORDER(torch.randn(n, k).bfloat16(), 1) for n, k in shapes]
    inputs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}

    def step() -> None:
        for (_, k), weight in zip(shapes, weights, strict=True):
            LINEAR(inputs[k], weight, None, "none", [], "")

    seconds = _median_seconds(step, 7)
    params = sum(n * k for n, k in shapes)
    return {
        "rows": rows,
        "ms": seconds * 1e3,
        "weight_gb_s": params * 2 / seconds / 1e9,
        "gflop_s": 2 * rows * params / seconds / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth, peak = memory_bandwidth(), matmul_peak()
    one, many = projections(1), projections(64)
    result = {
        "threads": torch.get_num_threads(),
        "memory_gb_s": bandwidth,
        "bf16_matmul_gflop_s": peak,
        "projections_1_row": one,
        "projections_64_rows": many,
        "fraction_of_bandwidth_at_1_row": one["weight_gb_s"] / bandwidth,
        "fraction_of_peak_at_64_rows": many["gflop_s"] / peak,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
