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

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the GPU extra is not installed: the runner keeps its torch path
    triton = None

BLOCK_M = 16  # consecutive tokens of one sequence per program
BLOCK_N = 32  # keys per tile, at absolute positions k * BLOCK_N


def available() -> bool:
    """Whether Triton is installed (the kernels run on a CUDA device, or anywhere under
    ``TRITON_INTERPRET=1``)."""
    return triton is not None


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


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _dot(a, b, exact: tl.constexpr):  # type: ignore[no-untyped-def]
        """``a @ b`` in float32: on the GPU's tensor cores from the inputs' bfloat16, or in
        exact float32 products (``exact``), which float32 models need (not TF32) and Triton's
        interpreter too: its bfloat16 ``dot`` reads the raw bits."""
        if exact:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        tile_seq_ptr,
        tile_first_ptr,
        tile_rows_ptr,
        positions_ptr,
        scale,
        window,
        stride_qt,
        stride_kr,
        stride_table,
        stride_ot,
        block_size: tl.constexpr,
        groups: tl.constexpr,
        group_pad: tl.constexpr,
        head_dim: tl.constexpr,
        dim_pad: tl.constexpr,
        kv_heads: tl.constexpr,
        block_m: tl.constexpr,
        block_n: tl.constexpr,
        exact_dots: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        n_rows = tl.load(tile_rows_ptr + tile)
        # Rows: token-major, the query heads of this KV head within each token.
        r = tl.arange(0, block_m * group_pad)
        token = first + r // group_pad
        group = r % group_pad
        row_ok = (r // group_pad < n_rows) & (group < groups)
        head = kv_head * groups + group
        d = tl.arange(0, dim_pad)
        d_ok = d < head_dim
        position = tl.load(positions_ptr + token, mask=row_ok, other=0)
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * head_dim + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        last = tl.max(tl.where(row_ok, position, 0), axis=0)
        lowest = tl.min(tl.where(row_ok, position, last), axis=0)
        start = 0
        if window > 0:
            start = tl.maximum(lowest - window + 1, 0) // block_n * block_n
        m_i = tl.full([block_m * group_pad], float("-inf"), tl.float32)
        l_i = tl.zeros([block_m * group_pad], tl.float32)
        acc = tl.zeros([block_m * group_pad, dim_pad], tl.float32)
        for key0 in range(start, last + 1, block_n):
            n = key0 + tl.arange(0, block_n)
            in_pool = n <= last
            block = tl.load(
                tables_ptr + seq * stride_table + n // block_size, mask=in_pool, other=0
            )
            cache_row = block * block_size + n % block_size
            kv_offsets = cache_row[:, None] * stride_kr + kv_head * head_dim + d[None, :]
            kv_mask = in_pool[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
            scores = _dot(q, tl.trans(k), exact_dots) * scale
            visible = (n[None, :] <= position[:, None]) & row_ok[:, None]
            if window > 0:
                visible = visible & (n[None, :] > position[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row that has seen nothing yet keeps m = -inf and its zeros (alpha scales
            # zeros, nothing is added) instead of turning into NaN: -inf less 0, never -inf.
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(visible, tl.exp(scores - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, exact_dots)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * head_dim + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


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
    if triton is None:
        raise RuntimeError("the GPU attention kernels need Triton: pip install -e '.[gpu]'")
    tokens, heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    groups = heads // kv_heads
    out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    q = q.contiguous()
    _paged_attention_kernel[(len(tiles), kv_heads)](
        q, key_cache, value_cache, out, block_tables, tiles.seq, tiles.first, tiles.rows,
        positions, scale, window,
        q.stride(0), key_cache.stride(0), block_tables.stride(0), out.stride(0),
        block_size=block_size, groups=groups, group_pad=_next_power_of_two(groups),
        head_dim=head_dim, dim_pad=max(16, _next_power_of_two(head_dim)), kv_heads=kv_heads,
        block_m=BLOCK_M, block_n=BLOCK_N,
        exact_dots=interpreted() or q.dtype == torch.float32,  # not TF32 for float32 models
    )  # fmt: skip
    return out
