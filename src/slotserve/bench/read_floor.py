"""One decode stream's read floor: how fast the box's memory streams (a sum over an array far
larger than its caches, on the servers' threads) and how many bytes of a GGUF's weights a
decoded token reads; their quotient is the fastest a step can be when every weight is read once.
The rate swings on a shared VM, so the sweep measures it beside each one-stream run."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

READ_BYTES = 1 << 30


def read_rate_gb_s(threads: int, repeats: int = 5) -> float:
    """GB/s (10⁹ bytes) of a float32 sum over 1 GiB cut into ``threads`` parts summed at once,
    the best of ``repeats`` (numpy's reductions release the GIL)."""
    values = np.ones(READ_BYTES // 4, dtype=np.float32)
    parts = np.array_split(values, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            started = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - started)
    return READ_BYTES / best / 1e9


def bytes_per_token(model: Path) -> int | None:
    """Bytes of a GGUF's tensors a decoded token reads: all of them, but the token embedding
    where the file has an output matrix of its own (a token then reads one row of it). None
    for a model that is not a GGUF file."""
    if not model.is_file():
        return None
    from slotserve.runners.pytorch.load.gguf_header import GgufHeader

    sizes = {t.name: t.data.nbytes for t in GgufHeader(model).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())
