"""The PyTorch runner's quantized projections (``csrc/quant_gemm.h``): this checkout's build
against another git revision's, both loaded in one process, calls alternated (A B B A ...), per
GGUF type at one row (a decode step) and at 2, 4, 16 and 64 (batches, prefill chunks):

    python benchmarks/quant_ab.py --base-rev HEAD~1 [--threads 2] [--pairs 9] [--json FILE]
    python benchmarks/quant_ab.py --base-isa avx2     # this build's AVX2 code as the base
    python benchmarks/quant_ab.py --base-rev HEAD --isa avx2  # both builds' AVX2 code
    python benchmarks/quant_ab.py --base-sources DIR  # a copy of csrc/ with something changed
    python benchmarks/quant_ab.py --base-small-pages  # this build, weights on 4 KiB pages as base
    python benchmarks/quant_ab.py --base-tiles none   # this build without AMX tiles as the base

A case is one projection of Llama-3.2-1B's MLP width (2,048 outputs, 8,192 inputs), eight
copies called in turn so the weights come from memory, as a forward's layers do; each build's
copies are packed as its revision packs them, and held where the runner holds them (the
kernels' weight buffers, on huge pages where Linux grants them; ``--base-small-pages``: the
base's in torch's own memory). Prints each build's median time per call, this
build's GB/s of weights and GFLOP/s, and the median of the paired ratios base ÷ this one. The
two builds' bits may differ where the stated arithmetic changed between the revisions (inputs
rounded to other steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kernel_revision import build_revision, quant_modules_at

from slotserve.runners.pytorch.cpu_kernels import CpuKernels, compile_module, load_cpu_kernels
from slotserve.runners.pytorch.quant import formats
from slotserve.runners.pytorch.quant.formats import FORMATS

OUTPUTS, INPUTS, COPIES = 2048, 8192, 8
ROWS = (1, 2, 4, 16, 64)
# Where each type's fp16 scales sit in its block: random bytes there could be NaN or tiny.
SCALES = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_blocks(kind: GGMLQuantizationType, seed: int) -> np.ndarray:
    """A weight of OUTPUTS × INPUTS in ``kind``: random codes, fp16 scales of plausible size."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(OUTPUTS * INPUTS // block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        scales = np.asarray(rng.uniform(1e-3, 4e-3, raw.shape[0]), dtype=np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(OUTPUTS, -1)


def packed_as(build: CpuKernels, f: Any, kind: GGMLQuantizationType, raw: np.ndarray) -> Any:
    """``raw`` packed by ``build``'s own packer in the format ``f`` of its revision."""
    out = torch.empty(f.packed_bytes(raw.shape[0], INPUTS), dtype=torch.uint8)
    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    build._m.quant_pack(
        blocks, None, int(kind), INPUTS, f.bits, f.offset, f.has_min, f.sub, f.super, out
    )
    return out


def held(kernels: CpuKernels, packed: torch.Tensor) -> torch.Tensor:
    """A copy of ``packed`` where the runner holds packed weights."""
    return kernels.huge_page_buffer(packed.numel()).copy_(packed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base_arg = parser.add_mutually_exclusive_group(required=True)
    base_arg.add_argument("--base-rev", help="git revision to compare against")
    base_arg.add_argument("--base-isa", help="this build's kernels for another instruction set")
    base_arg.add_argument("--base-sources", type=Path, help="kernel sources to build as the base")
    base_arg.add_argument(
        "--base-small-pages", action="store_true", help="this build, its weights on 4 KiB pages"
    )
    base_arg.add_argument(
        "--base-tiles", help="this build, its quantized steps on these tiles (none, amx) as base"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows per call")
    parser.add_argument("--isa", help="the instruction set this build (and a base revision) runs")
    parser.add_argument("--types", help="comma-separated GGUF types (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=9, help="paired passes per case")
    parser.add_argument("--json", type=Path, help="write the cases' figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels do not run here")
    results: list[dict[str, Any]] = []
    this_isa = args.isa or kernels.isa
    isas = {"base": args.base_isa or this_isa, "this": this_isa}
    with tempfile.TemporaryDirectory() as folder:
        module: Any = None
        if args.base_rev is not None:
            module = build_revision(args.base_rev, Path(folder), "quant_ab_base")
        elif args.base_sources is not None:
            build_dir = Path(folder) / "build"
            build_dir.mkdir()
            module = compile_module(args.base_sources, "quant_ab_sources", build_dir)
        base = kernels if module is None else CpuKernels(module)
        # A revision from before the kernels packed their own records: its numpy packing.
        old_packing = module is not None and not hasattr(module, "quant_pack")
        if old_packing and args.base_rev is None:
            raise SystemExit("these base sources do not pack their records: use --base-rev")
        at_rev = (
            quant_modules_at(
                args.base_rev, Path(folder), ("formats", "packing") if old_packing else ("formats",)
            )
            if args.base_rev is not None
            else {}
        )
        base_packing: Any = at_rev.get("packing")
        base_formats: Any = at_rev.get("formats", formats)
        print(f"instruction sets: base {isas['base']}, this {isas['this']}")
        header = ("case", "base ms", "this ms", "GB/s", "GFLOP/s", "base/this")
        print("{:14s} {:>9s} {:>9s} {:>6s} {:>8s} {:>9s}".format(*header))
        kinds = (
            [GGMLQuantizationType[name] for name in args.types.split(",")] if args.types else SCALES
        )
        for kind in kinds:
            raw = random_blocks(kind, seed=1)
            packed = kernels.quant_pack(kind, raw, INPUTS)
            base_packed = (
                base_packing.pack_tensor(kind, raw, INPUTS)
                if base_packing is not None
                else packed_as(base, base_formats.FORMATS[kind], kind, raw)
            )
            weights = {
                "base": [
                    base_packed.clone() if args.base_small_pages else held(kernels, base_packed)
                    for _ in range(COPIES)
                ],
                "this": [held(kernels, packed) for _ in range(COPIES)],
            }
            base_format = base_formats.FORMATS[kind]
            for rows in args.rows:
                x = torch.randn(rows, INPUTS, generator=torch.Generator().manual_seed(rows))
                x = x.bfloat16()
                times: dict[str, list[float]] = {"base": [], "this": []}
                ratios = []
                builds = (("base", base, base_format), ("this", kernels, FORMATS[kind]))
                tiles = {"base": args.base_tiles or "", "this": ""}
                for pair in range(args.pairs):
                    # Each build first in every other pair: going second was worth up to ±15%.
                    for label, build, form in builds if pair % 2 == 0 else builds[::-1]:
                        build.select_isa(isas[label])
                        started = time.perf_counter()
                        for weight in weights[label]:
                            build.quant_linear(x, weight, form, OUTPUTS, None, tiles[label])
                        times[label].append((time.perf_counter() - started) / COPIES)
                    ratios.append(times["base"][-1] / times["this"][-1])
                this_s = statistics.median(times["this"])
                case = {
                    "type": kind.name,
                    "rows": rows,
                    "base_ms": statistics.median(times["base"]) * 1e3,
                    "this_ms": this_s * 1e3,
                    "gb_s": packed.numel() / this_s / 1e9,
                    "gflop_s": 2 * rows * OUTPUTS * INPUTS / this_s / 1e9,
                    "base_over_this": statistics.median(ratios),
                }
                results.append(case)
                print(
                    f"{kind.name + ' × ' + str(rows):14s} {case['base_ms']:9.3f} "
                    f"{case['this_ms']:9.3f} {case['gb_s']:6.1f} {case['gflop_s']:8.1f} "
                    f"{case['base_over_this']:9.2f}",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
