"""Attention over the paged KV pool, batch-invariant by construction.

Each layer's cache is one tensor ``[(num_blocks + 1) * block_size, kv_heads, head_dim]`` (int8
rows with a scale each under ``--kv-cache-dtype int8``, read back as gathered: ``kv_int8.py``):
row ``block * block_size + offset`` holds one position; the last block is never allocated and stays
zero, so gathers can pad with it. Per step the runner builds :class:`StepAttention`: the tokens'
cache rows (where new K/V go) and groups of sequences that attend together: all decode tokens
in one group, each prefill chunk in its own.

Per group and layer: new K/V are written, the group's K/V rows are gathered into
``[batch * kv_heads, kv_len, head_dim]`` (padding with the zero block), and attention is plain
``bmm → mask → softmax (float32) → bmm``. Why not ``scaled_dot_product_attention``: its CPU
kernel picks block sizes from the padded length, so a sequence's result would depend on the
longest sequence beside it. ``bmm`` and ``linear`` in bfloat16 give every row the same bits
whatever the batch, and zero padding of the reduced dimension is exact in whole blocks of 16
(not in part blocks), so ``kv_len`` is always whole pool blocks: every token is computed
identically alone, batched, as a decode step or inside any prefill chunk (grain 1). The
measurements: docs/design/batch-invariance.md.

::

    pool rows (block_size 4):  [b0: p0 p1 p2 p3][b1: p4 p5 . .] ... [zero block]
    sequence table [b0, b1], 6 positions, kv_len padded to 8 (whole blocks):
    gather rows  = b0*4+0 .. b0*4+3, b1*4+0, b1*4+1, zero, zero   (× kv_heads, head-major)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slotserve.runners.pytorch.gpu_kernels import RowTiles, paged_attention
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.kv_int8 import int8_rows, values_of


@dataclass
class AttentionGroup:
    """Sequences that attend together: token rows ``start .. start + batch * q_len`` of the
    step, sequence-major; ``gather``: cache rows × kv heads to read, ``[batch * kv_heads *
    kv_len]``; ``mask`` (and ``sliding_mask``): ``[batch, 1, q_len, kv_len]``, True = attend."""

    start: int
    batch: int
    q_len: int
    kv_len: int
    gather: torch.Tensor
    mask: torch.Tensor
    sliding_mask: torch.Tensor | None


@dataclass
class PagedStep:
    """The step as the CPU kernels read the pool (``cpu_kernels.py``): no gather, no mask,
    int32 numbers per token and per sequence."""

    block_tables: torch.Tensor  # [sequences, blocks], padded with 0 past each table's end
    token_seq: torch.Tensor  # [tokens]: the token's row of block_tables
    positions: torch.Tensor  # [tokens]
    cache_rows: torch.Tensor  # [tokens]: where the token's K/V go
    block_size: int
    prompt_rows: torch.Tensor | None = None  # [tokens] bool: a prompt's token (None: none is)

    def to(self, device: torch.device) -> PagedStep:
        return PagedStep(
            self.block_tables.to(device),
            self.token_seq.to(device),
            self.positions.to(device),
            self.cache_rows.to(device),
            self.block_size,
            self.prompt_rows,
        )


@dataclass
class StepAttention:
    write_rows: torch.Tensor  # [tokens]: the cache row each token's K/V goes to
    groups: list[AttentionGroup]
    # Instead of the groups: the pool as the kernels read it in place, the CPU kernels' or,
    # with its row tiles, the Triton kernel's (``gpu_kernels.py``).
    paged: PagedStep | None = None
    tiles: RowTiles | None = None
    # Image tokens that see their whole image (Gemma 3): each run's rows, attended again
    # with ``bidirectional`` groups over the rows the other paths gave (``attend_images``).
    image_groups: list[AttentionGroup] = field(default_factory=list)


def build_group(
    start: int,
    tables: list[list[int]],
    starts: list[int],
    q_len: int,
    block_size: int,
    zero_block: int,
    num_kv_heads: int,
    sliding_window: int | None,
    device: torch.device,
    bidirectional: bool = False,
) -> AttentionGroup:
    """Metadata for sequences with block ``tables`` whose ``q_len`` new tokens start at
    positions ``starts`` (all decode tokens: q_len 1; a prefill chunk: batch 1);
    ``bidirectional``: every new token also sees those after it (an image's tokens)."""
    batch = len(tables)
    lengths = [s + q_len for s in starts]
    # Whole blocks: the reduced dimension of ``probs @ values`` must not depend on the
    # neighbours' lengths (see the module docstring).
    blocks_per_row = -(-max(lengths) // block_size)
    kv_len = blocks_per_row * block_size
    padded = []
    for b, blocks in enumerate(tables):
        used = blocks[: -(-lengths[b] // block_size)]
        padded.append(used + [zero_block] * (blocks_per_row - len(used)))
    table = torch.tensor(padded, dtype=torch.int64)
    positions = torch.arange(kv_len, dtype=torch.int64)
    rows = table[:, positions // block_size] * block_size + positions % block_size
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    rows = torch.where(valid, rows, zero_block * block_size)
    heads = torch.arange(num_kv_heads, dtype=torch.int64)
    gather = (rows[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    query_pos = torch.tensor(starts)[:, None] + torch.arange(q_len)[None, :]  # [batch, q_len]
    last = torch.tensor(lengths)[:, None] - 1 if bidirectional else query_pos
    causal = positions[None, None, :] <= last[:, :, None]  # [batch, q_len, kv_len]
    sliding = None
    if sliding_window:
        sliding = causal & (positions[None, None, :] > query_pos[:, :, None] - sliding_window)
        sliding = sliding[:, None].to(device)
    return AttentionGroup(
        start, batch, q_len, kv_len, gather.to(device), causal[:, None].to(device), sliding
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: StepAttention,
    sliding: bool,
    config: ModelConfig,
) -> torch.Tensor:
    """``q``: [tokens, heads, head_dim]; ``k``/``v``: [tokens, kv_heads, head_dim]. Writes the
    new K/V into the caches, returns [tokens, heads * head_dim]."""
    if key_cache.dtype == torch.uint8:  # an int8 pool: each row as its codes and scale
        k, v = int8_rows(k), int8_rows(v)
    key_cache.index_copy_(0, step.write_rows, k)
    value_cache.index_copy_(0, step.write_rows, v)
    if step.paged is not None and step.tiles is not None:
        paged = step.paged
        window = (config.sliding_window or 0) if sliding else 0
        return paged_attention(
            q, key_cache, value_cache, paged.block_tables, step.tiles, paged.positions,
            paged.block_size, window, config.attention_scale,
        )  # fmt: skip
    caches = key_cache, value_cache
    outputs = [_group_attention(q, caches, group, sliding, config) for group in step.groups]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def attend_images(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    step: StepAttention,
    sliding: bool,
    config: ModelConfig,
) -> torch.Tensor:
    """``out`` with the rows of ``step.image_groups`` attended again, each image token over
    its whole image (their K/V are in the caches already). Those rows always take this path,
    whatever else is in the step, so their bits never depend on the batch."""
    for group in step.image_groups:
        rows = _group_attention(q, (key_cache, value_cache), group, sliding, config)
        out[group.start : group.start + group.q_len] = rows.to(out.dtype)
    return out


def _group_attention(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    group: AttentionGroup,
    sliding: bool,
    config: ModelConfig,
) -> torch.Tensor:
    """One group's attention over the key and value caches, ``[batch * q_len, heads *
    head_dim]``; a sliding layer masks by its window."""
    mask = group.sliding_mask if sliding and group.sliding_mask is not None else group.mask
    if q.device.type == "cuda":  # no batch-invariance claim on GPUs: take SDPA's kernels
        return _sdpa(q, *caches, group, mask, config)
    keys, values = (_gathered(cache, group.gather, q.dtype) for cache in caches)
    kv_heads, groups, dim = config.num_kv_heads, config.num_query_groups, config.head_dim
    b, qn, kv_len = group.batch, group.q_len, group.kv_len
    query = q[group.start : group.start + b * qn]
    # [b*qn, heads, dim] → [b * kv_heads, groups * qn, dim]; head h reads kv head h // groups.
    query = query.view(b, qn, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
    query = query.reshape(b * kv_heads, groups * qn, dim)
    keys, values = keys.view(b * kv_heads, kv_len, dim), values.view(b * kv_heads, kv_len, dim)
    scores = torch.bmm(query, keys.transpose(1, 2)) * config.attention_scale
    scores = scores.float().view(b, kv_heads, groups, qn, kv_len)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b * kv_heads, groups * qn, kv_len)
    out = torch.bmm(probs, values).view(b, kv_heads, groups, qn, dim)
    return out.permute(0, 3, 1, 2, 4).reshape(b * qn, kv_heads * groups * dim)


def _gathered(cache: torch.Tensor, gather: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows ``gather`` (rows × KV heads) as ``[len(gather), head_dim]`` values;
    an int8 pool's read back to ``dtype``."""
    rows = cache.view(-1, cache.shape[-1]).index_select(0, gather)
    return values_of(rows, dtype) if cache.dtype == torch.uint8 else rows


def _sdpa(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    mask: torch.Tensor,
    config: ModelConfig,
) -> torch.Tensor:
    """The same attention through ``scaled_dot_product_attention`` (GPU)."""
    b, qn, kv_len = group.batch, group.q_len, group.kv_len
    kv_heads, dim = config.num_kv_heads, config.head_dim
    query = q[group.start : group.start + b * qn].view(b, qn, config.num_heads, dim)
    keys, values = (
        _gathered(cache, group.gather, q.dtype).view(b, kv_heads, kv_len, dim)
        for cache in (key_cache, value_cache)
    )
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=mask,
        scale=config.attention_scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(b * qn, config.num_heads * dim)
