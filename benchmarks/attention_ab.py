"""The PyTorch runner's paged attention kernel: this checkout's build against another git
revision's, both loaded in one process, calls alternated (A B A B ...), on shapes of the
embedded model's serving (prefill chunks at long contexts, decode rows) and decode rows on
Llama-3.2-1B's heads (the cases named ``1B:``):

    python benchmarks/attention_ab.py --base-rev HEAD~1 [--threads 2] [--pairs 9] [--layers 30]
        [--only 'decode'] [--isa avx2] [--kv-int8] [--base-attention vector]

Prints, per case, each build's median time per call and the median of the paired ratios
base ÷ this one, and whether the two builds gave the same bits. Keys sit in scattered pool
blocks of 16 positions, as the runner keeps them. With ``--layers 1`` (the default) every call
reads the same pool, which stays in the caches; with ``--layers 30`` a timed pass calls each of
30 pools once, as a forward calls its layers, so the KV comes from memory as in the engine.
``--kv-int8``: the pools hold int8 rows (``--kv-cache-dtype int8``). ``--base-attention`` and
``--attention`` choose each build's arithmetic (``amx``, ``vector``; by default the host's).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from kernel_revision import build_revision

from slotserve.runners.pytorch.cpu_kernels import load_cpu_kernels
from slotserve.runners.pytorch.model.kv_int8 import int8_rows

BLOCK = 16
SMOLLM2_135M, LLAMA_3_2_1B = (9, 3), (32, 8)  # query and KV heads, of 64 dimensions each
DIM = 64


def case(
    lengths: list[int],
    rows: list[tuple[int, int]],
    shared: int = 0,
    seed: int = 0,
    heads: tuple[int, int] = SMOLLM2_135M,
) -> tuple[Any, ...]:
    """Sequences of ``lengths`` (the first ``shared`` positions in common blocks) and query
    rows (sequence, position), over ``heads``: the paged_attention arguments."""
    num_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    keys = torch.randn(blocks * BLOCK, kv_heads, DIM, generator=gen).bfloat16()
    values = torch.randn(blocks * BLOCK, kv_heads, DIM, generator=gen).bfloat16()
    free = torch.randperm(blocks, generator=gen).tolist()
    common = [free.pop() for _ in range(shared // BLOCK)]
    tables = [common + [free.pop() for _ in range(-(-n // BLOCK) - len(common))] for n in lengths]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(rows), num_heads, DIM, generator=gen).bfloat16()
    seqs = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int32)
    return (q, keys, values, table, seqs, positions, BLOCK, 0, 1 / math.sqrt(DIM))


CASES: dict[str, Callable[[int], tuple[Any, ...]]] = {  # a pool per seed
    "122-row chunk at 6.4k + 5 decodes": lambda seed: case(
        [6522] + [6500] * 5,
        [(0, 6400 + i) for i in range(122)] + [(1 + j, 6499) for j in range(5)],
        shared=6144,
        seed=seed,
    ),
    "512-row chunk at 5.6k": lambda seed: case(
        [6144], [(0, 5632 + i) for i in range(512)], seed=seed
    ),
    "512-row chunk from 0": lambda seed: case([512], [(0, i) for i in range(512)], seed=seed),
    "6 decodes at 6.5k, shared prefix": lambda seed: case(
        [6500] * 6, [(j, 6499) for j in range(6)], shared=6144, seed=seed
    ),
    "3 decodes at 6.5k shared + 2 at 400": lambda seed: case(
        [6500] * 3 + [400] * 2,
        [(j, 6499) for j in range(3)] + [(3, 399), (4, 399)],
        shared=6144,
        seed=seed,
    ),
    "6 decodes at 6.5k": lambda seed: case([6500] * 6, [(j, 6499) for j in range(6)], seed=seed),
    "64 decodes at 190": lambda seed: case([190] * 64, [(j, 189) for j in range(64)], seed=seed),
    "2 decodes at 6.5k + 4 at 100": lambda seed: case(
        [6500, 6500] + [100] * 4,
        [(0, 6499), (1, 6499)] + [(j, 99) for j in range(2, 6)],
        shared=6144,
        seed=seed,
    ),
    "1 decode at 200": lambda seed: case([200], [(0, 199)], seed=seed),
    "1 decode at 1k": lambda seed: case([1000], [(0, 999)], seed=seed),
    "1 decode at 4k": lambda seed: case([4000], [(0, 3999)], seed=seed),
    "1 decode at 16k": lambda seed: case([16384], [(0, 16383)], seed=seed),
    "1 decode at 6.5k + 5 at 100": lambda seed: case(
        [6500] + [100] * 5, [(0, 6499)] + [(j, 99) for j in range(1, 6)], seed=seed
    ),
    "1B: 1 decode at 4k": lambda seed: case([4000], [(0, 3999)], seed=seed, heads=LLAMA_3_2_1B),
    "1B: 1 decode at 10k": lambda seed: case([10000], [(0, 9999)], seed=seed, heads=LLAMA_3_2_1B),
    "1B: 4 decodes at 10k": lambda seed: case(
        [10000] * 4, [(j, 9999) for j in range(4)], seed=seed, heads=LLAMA_3_2_1B
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-rev", required=True, help="git revision to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=9, help="paired calls per case")
    parser.add_argument(
        "--layers", type=int, default=1, help="pools per case, each call of a pass on the next"
    )
    parser.add_argument("--only", default="", help="the cases whose names contain this text")
    parser.add_argument("--isa", help="the instruction set both builds run (e.g. avx2)")
    parser.add_argument("--kv-int8", action="store_true", help="pools of int8 rows")
    parser.add_argument("--base-attention", help="the base build's arithmetic (amx, vector)")
    parser.add_argument("--attention", help="this build's arithmetic (amx, vector)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels do not run here")
    with tempfile.TemporaryDirectory() as folder:
        base = build_revision(args.base_rev, Path(folder), "attention_ab_base")
        if args.isa:
            kernels.select_isa(args.isa)
            base.select_isa(args.isa)
        if args.base_attention:
            base.select_attention(args.base_attention)
        if args.attention:
            kernels.select_attention(args.attention)
        print(f"{'case':36s} {'base ms':>9s} {'this ms':>9s} {'base/this':>9s}  bits")
        for name, make in CASES.items():
            if args.only not in name:
                continue
            calls = [make(seed) for seed in range(args.layers)]
            if args.kv_int8:
                calls = [(c[0], int8_rows(c[1]), int8_rows(c[2]), *c[3:]) for c in calls]
            same = all(
                torch.equal(base.paged_attention(*call), kernels.paged_attention(*call))
                for call in calls
            )
            times: dict[str, list[float]] = {"base": [], "this": []}
            ratios = []
            builds = (("base", base.paged_attention), ("this", kernels.paged_attention))
            for _ in range(args.pairs):
                for label, run in builds:
                    started = time.perf_counter()
                    for call in calls:
                        run(*call)
                    times[label].append((time.perf_counter() - started) / len(calls))
                ratios.append(times["base"][-1] / times["this"][-1])
            print(
                f"{name:36s} {statistics.median(times['base']) * 1e3:9.3f} "
                f"{statistics.median(times['this']) * 1e3:9.3f} {statistics.median(ratios):9.2f}  "
                f"{'equal' if same else 'differ'}"
            )
            del calls


if __name__ == "__main__":
    main()
