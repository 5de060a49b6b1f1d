"""The box's limits beside what the PyTorch runner's projections reach on them.

Measures, with torch's threads (``--threads``): the memory bandwidth (a float32 sum over a
buffer far larger than the caches), the bfloat16 matmul peak as oneDNN and the runner's CPU
kernels reach it (a large square matmul, weights packed once), and one decode step's
projections of the embedded SmolLM2 shapes (30 layers of distinct weights and the head) at 1,
16 and 64 rows through each: GB/s of weights read, GFLOP/s. oneDNN's rows split the down
projection's input as the runner does without the kernels (batch invariance); the kernels'
GEMM needs no split. With ``--shapes``, single matmuls of larger models' shapes through each.

    python benchmarks/cpu_limits.py --threads 2

The result names the CPU (model name, and whether it has AMX-BF16 and AVX512-BF16) and which of
our GEMMs served (``amx`` or ``avx512bf16``): figures belong to one CPU kind.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slotserve.runners.pytorch.cpu_kernels import CpuKernels, load_cpu_kernels

REORDER = torch.ops.mkldnn._reorder_linear_weight
LINEAR = torch.ops.mkldnn._linear_pointwise

# SmolLM2-135M: (rows, input) of each layer's projections; for oneDNN down's 1,536-long input
# is split into two 768-long halves, as the runner splits it (batch invariance).
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYER_ONEDNN = [(960, 576), (576, 576), (3072, 576), (576, 768), (576, 768)]
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


def linear_of(weight: torch.Tensor, kernels: CpuKernels | None) -> Callable[[torch.Tensor], object]:
    """``x ↦ x @ weight.T`` with the weight packed once: oneDNN's prepacked call without
    ``kernels``, else the kernels' GEMM."""
    if kernels is None:
        prepacked = REORDER(weight, 1)
        return lambda x: LINEAR(x, prepacked, None, "none", [], "")
    gemm, packed, outputs = kernels, kernels.pack_weight(weight), weight.shape[0]
    return lambda x: gemm.linear(x, packed, None, outputs)


def matmul_peak(kernels: CpuKernels | None) -> float:
    n = 4096
    x, w = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    seconds = _median_seconds(functools.partial(linear_of(w, kernels), x), 5)
    return 2 * n**3 / seconds / 1e9


def projections(rows: int, kernels: CpuKernels | None) -> dict[str, float]:
    """One decode step's projections: oneDNN's prepacked call, or the kernels' GEMM."""
    shapes = (LAYER_ONEDNN if kernels is None else LAYER) * LAYERS + [HEAD]
    inputs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
    calls = [linear_of(torch.randn(n, k).bfloat16(), kernels) for n, k in shapes]

    def step() -> None:
        for (_, k), call in zip(shapes, calls, strict=True):
            call(inputs[k])

    seconds = _median_seconds(step, 7)
    params = sum(n * k for n, k in shapes)
    return {
        "rows": rows,
        "ms": seconds * 1e3,
        "weight_gb_s": params * 2 / seconds / 1e9,
        "gflop_s": 2 * rows * params / seconds / 1e9,
    }


# (rows, outputs, inputs): a square matmul; Qwen3-0.6B's MLP at a 512-token prefill; Llama-3.2-1B's
# MLP at 512 rows, at 64 and at one.
SHAPES = [
    (4096, 4096, 4096),
    (512, 3072, 1024),
    (512, 1024, 3072),
    (512, 8192, 2048),
    (512, 2048, 8192),
    (64, 8192, 2048),
    (1, 8192, 2048),
]


def larger_shapes(kernels: CpuKernels) -> list[dict[str, float]]:
    rows = []
    for m, n, k in SHAPES:
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        onednn = _median_seconds(functools.partial(linear_of(w, None), x), 5)
        ours = _median_seconds(functools.partial(linear_of(w, kernels), x), 5)
        flop = 2 * m * n * k
        rows.append(
            {"m": m, "n": n, "k": k, "onednn_gflop_s": flop / onednn / 1e9,
             "kernels_gflop_s": flop / ours / 1e9}
        )  # fmt: skip
    return rows


def cpu_identity() -> dict[str, object]:
    """The CPU's model name and the flags that decide which GEMM serves."""
    model, flags = "unknown", set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"model": model, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--shapes", action="store_true", help="larger models' shapes too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    paths: dict[str, CpuKernels | None] = {"onednn": None}
    if kernels is not None and kernels.has_gemm:
        paths["kernels"] = kernels
    bandwidth = memory_bandwidth()
    peaks = {name: matmul_peak(k) for name, k in paths.items()}
    peak = max(peaks.values())
    result: dict[str, object] = {
        "cpu": cpu_identity(),
        "gemm": kernels.gemm if kernels is not None else "none",
        "threads": torch.get_num_threads(),
        "memory_gb_s": bandwidth,
        "bf16_matmul_gflop_s": peaks,
    }
    for name, k in paths.items():
        steps = [projections(rows, k) for rows in (1, 16, 64, 512)]
        result[f"projections_{name}"] = steps
        result[f"{name}_fraction_of_bandwidth_at_1_row"] = steps[0]["weight_gb_s"] / bandwidth
        result[f"{name}_fraction_of_peak_at_64_rows"] = steps[2]["gflop_s"] / peak
    if args.shapes and "kernels" in paths and kernels is not None:
        result["larger_shapes"] = larger_shapes(kernels)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
