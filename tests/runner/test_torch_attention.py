"""The PyTorch runner's attention over the paged pool, on small random tensors: the batch-
invariant path (bmm) against a dense reference, its invariance to what runs beside a sequence,
and the GPU path (SDPA), which runs on CPU tensors too."""

from __future__ import annotations

import math

import pytest
import torch

from slotserve.runners.pytorch.model.attention import StepAttention, _sdpa, attend, build_group
from slotserve.runners.pytorch.model.config import ModelConfig

BLOCK = 4


def _config(sliding_window: int | None = None) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        name="tiny",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        sliding_window=sliding_window,
    )


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None):
    """Causal attention for one sequence: q [n, heads, dim] at positions start..; k/v the
    whole context [start + n, kv_heads, dim]."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(dim)
    positions = torch.arange(k.shape[0])
    query_pos = start + torch.arange(q.shape[0])
    allowed = positions[None, :] <= query_pos[:, None]
    if window:
        allowed &= positions[None, :] > query_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).reshape(q.shape[0], -1)


def _setup(lengths: list[int], config: ModelConfig, dtype: torch.dtype):
    """A pool holding each sequence's context in scattered blocks, and the contexts."""
    generator = torch.Generator().manual_seed(0)
    kv, dim = config.num_kv_heads, config.head_dim
    num_blocks = 64
    key_cache = torch.zeros((num_blocks + 1) * BLOCK, kv, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = list(torch.randperm(num_blocks, generator=generator).tolist())
    tables, contexts = [], []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        keys = torch.randn(length, kv, dim, generator=generator).to(dtype)
        values = torch.randn(length, kv, dim, generator=generator).to(dtype)
        for p in range(length):
            row = table[p // BLOCK] * BLOCK + p % BLOCK
            key_cache[row], value_cache[row] = keys[p], values[p]
        tables.append(table)
        contexts.append((keys, values))
    return key_cache, value_cache, tables, contexts, num_blocks


@pytest.mark.parametrize("window", [None, 5])
def test_decode_group_matches_dense_attention_and_each_sequence_alone(window: int | None) -> None:
    config, dtype = _config(window), torch.bfloat16
    lengths = [3, 9, 17]
    key_cache, value_cache, tables, contexts, zero = _setup(lengths, config, dtype)
    q = torch.randn(len(lengths), config.num_heads, config.head_dim).to(dtype)
    # The new token's K/V are the last context position; attend() writes them again.
    k_new = torch.stack([c[0][-1] for c in contexts])
    v_new = torch.stack([c[1][-1] for c in contexts])
    starts = [n - 1 for n in lengths]
    rows = torch.tensor(
        [t[s // BLOCK] * BLOCK + s % BLOCK for t, s in zip(tables, starts, strict=True)]
    )

    def run(indices: list[int]) -> torch.Tensor:
        group = build_group(
            0, [tables[i] for i in indices], [starts[i] for i in indices], 1, BLOCK, zero,
            config.num_kv_heads, window, torch.device("cpu"),
        )  # fmt: skip
        step = StepAttention(rows[indices], [group])
        return attend(q[indices], k_new[indices], v_new[indices], key_cache, value_cache, step,
                      window is not None, config)  # fmt: skip

    together = run([0, 1, 2])
    for i, (keys, values) in enumerate(contexts):
        expected = _dense(q[i : i + 1], keys, values, starts[i], window)
        torch.testing.assert_close(together[i : i + 1].float(), expected, atol=3e-2, rtol=3e-2)
        assert torch.equal(run([i])[0], together[i]), "batch-invariant: alone == beside others"


def test_prefill_chunk_after_cached_positions_matches_dense_attention() -> None:
    config, dtype = _config(), torch.float32
    key_cache, value_cache, tables, contexts, zero = _setup([12], config, dtype)
    keys, values = contexts[0]
    start, n = 5, 7  # positions 0..4 were cached; 5..11 are this chunk
    q = torch.randn(n, config.num_heads, config.head_dim)
    rows = torch.tensor([tables[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, 12)])
    group = build_group(0, tables, [start], n, BLOCK, zero, 2, None, torch.device("cpu"))
    out = attend(q, keys[start:], values[start:], key_cache, value_cache,
                 StepAttention(rows, [group]), False, config)  # fmt: skip
    torch.testing.assert_close(out, _dense(q, keys, values, start, None), atol=1e-5, rtol=1e-5)
    sdpa = _sdpa(q, key_cache.view(-1, 8), value_cache.view(-1, 8), group, group.mask, config)
    torch.testing.assert_close(sdpa, out, atol=1e-5, rtol=1e-5)
