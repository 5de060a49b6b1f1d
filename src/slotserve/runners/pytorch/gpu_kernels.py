"""The PyTorch runner's attention on GPUs: a Triton kernel that reads the paged KV pool in
place, through each sequence's block table, for decode and prefill rows alike (no gather into
padded tensors, no mask tensors), with GQA and sliding windows.

It takes what the CPU kernels take (``PagedStep`` in ``model/attention.py``: block tables,
each token's sequence and position), so one step plan serves both. Work is cut into programs of one
*row tile* (up to ``BLOCK_M`` consecutive tokens of one sequence) by one KV head, the query
heads that share that KV head stacked as rows.

Invariance (E4, carried to the GPU): a token's result depends on its own position, window and
sequence only. Every row walks the keys in tiles of ``BLOCK_N`` at fixed absolute positions
(multiples of ``BLOCK_N``) from 0 upwards, with one online softmax in that order. Keys a row
must not see are masked to -inf: a tile it cannot see at all leaves its running state exactly
as it was (the guards below), and past its own position a tile adds exact zeros. So its tile
mates (a prefill chunk's other rows, or none for a decode row) never change its bits, and a
decode step and a prefill chunk compute a token the same way. The kernel's launch shape is
fixed by the model's head sizes alone, never by the batch.

Tested on the CPU under ``TRITON_INTERPRET=1`` (tests/runner/test_gpu_kernels.py) against the
plain-torch attention.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

BLOCK_M = 16  # consecutive tokens of one sequence per program
BLOCK_N = 32  # keys per tile, at absolute positions k * BLOCK_N


@functools.cache
def available() -> bool:
    """Whether Triton is installed (the kernels run on a CUDA device, or anywhere under
    ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class RowTiles:
    """The step's tokens cut into row tiles: each its sequence (a row of the block tables), its
    first token and its number of tokens (int32 tensors on the kernel's device)."""

    seq: torch.Tensor
    first: torch.Tensor
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.seq.shape[0])


def row_tiles(token_seq: list[int], device: torch.device) -> RowTiles:
    """Runs of consecutive tokens of the same sequence, cut every ``BLOCK_M`` tokens."""
    seq: list[int] = []
    first: list[int] = []
    rows: list[int] = []
    for i, s in enumerate(token_seq):
        if seq and seq[-1] == s and first[-1] + rows[-1] == i and rows[-1] < BLOCK_M:
            rows[-1] += 1
        else:
            seq.append(s)
            first.append(i)
            rows.append(1)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return RowTiles(tensor(seq), tensor(first), tensor(rows))


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: RowTiles,
    positions: torch.Tensor,
    block_size: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each token over its sequence's positions up to its own (``window``
    > 0: the last ``window`` of them): ``q`` [tokens, heads, head_dim]; the caches [rows,
    kv_heads, head_dim] (row ``block * block_size + offset``); ``block_tables`` [sequences,
    blocks] int32; ``positions`` [tokens] int32. Returns [tokens, heads * head_dim]."""
    if not available():
        raise RuntimeError("the GPU attention kernels need Triton: pip install -e '.[gpu]'")
    from slotserve.runners.pytorch.gpu_attention_kernel import paged_attention_kernel

    tokens, heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    groups = heads // kv_heads
    out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    q = q.contiguous()
    paged_attention_kernel[(len(tiles), kv_heads)](
        q, key_cache, value_cache, out, block_tables, tiles.seq, tiles.first, tiles.rows,
        positions, scale, window,
        q.stride(0), key_cache.stride(0), block_tables.stride(0), out.stride(0),
        block_size=block_size, groups=groups, group_pad=_next_power_of_two(groups),
        head_dim=head_dim, dim_pad=max(16, _next_power_of_two(head_dim)), kv_heads=kv_heads,
        block_m=BLOCK_M, block_n=BLOCK_N,
        exact_dots=interpreted() or q.dtype == torch.float32,  # not TF32 for float32 models
    )  # fmt: skip
    return out
