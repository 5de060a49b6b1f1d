"""The GPU path's paged attention (runners/pytorch/gpu_kernels.py), run by Triton's interpreter
on the CPU (tests/conftest.py sets TRITON_INTERPRET where no NVIDIA GPU is): within bfloat16
rounding of dense float32 attention, and every token's bits its own, alone or beside others, in
a decode step or inside a prefill chunk."""

from __future__ import annotations

import pytest
import torch

from slotserve.runners.pytorch import gpu_kernels

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="Triton is not installed")

BLOCK = 16
CPU = torch.device("cpu")


class Pool:
    """A KV pool of random blocks and two sequences' scattered block tables."""

    def __init__(self, heads: int, kv_heads: int, dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows = 41 * BLOCK
        self.keys = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
        self.values = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
        self.tables = torch.tensor(
            [[3, 7, 1, 9, 12, 30, 0, 0, 0], [2, 4, 5, 6, 8, 10, 11, 13, 14]], dtype=torch.int32
        )
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.gen = gen

    def queries(self, tokens: int) -> torch.Tensor:
        return torch.randn(tokens, self.heads, self.dim, generator=self.gen).bfloat16()

    def attend(
        self, q: torch.Tensor, seqs: list[int], positions: list[int], window: int = 0
    ) -> torch.Tensor:
        return gpu_kernels.paged_attention(
            q, self.keys, self.values, self.tables, gpu_kernels.row_tiles(seqs, CPU),
            torch.tensor(positions, dtype=torch.int32), BLOCK, window, self.dim**-0.5,
        )  # fmt: skip

    def dense(
        self, q: torch.Tensor, seqs: list[int], positions: list[int], window: int
    ) -> torch.Tensor:
        out = []
        groups = self.heads // self.kv_heads
        for t, (s, p) in enumerate(zip(seqs, positions, strict=True)):
            n = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
            rows = self.tables[s][n // BLOCK].long() * BLOCK + n % BLOCK
            keys, values = self.keys[rows].float(), self.values[rows].float()
            query = q[t].float().view(self.kv_heads, groups, self.dim)
            probs = (torch.einsum("kgd,nkd->kgn", query, keys) * self.dim**-0.5).softmax(-1)
            out.append(torch.einsum("kgn,nkd->kgd", probs, values).reshape(-1))
        return torch.stack(out)


# A decode row of sequence 0 at each tile edge, then a prefill chunk of sequence 1 crossing
# row tiles (16 tokens) and key tiles (32 positions).
SEQS = [0, 0, 0, 0, 0, *[1] * 21]
POSITIONS = [0, 15, 31, 32, 95, *range(60, 81)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)], ids=["gqa3", "mha", "gqa4"]
)
@pytest.mark.parametrize("window", [0, 20], ids=["full", "sliding-window"])
def test_paged_attention_matches_dense_attention(
    heads: int, kv_heads: int, dim: int, window: int
) -> None:
    pool = Pool(heads, kv_heads, dim, seed=heads + dim)
    q = pool.queries(len(SEQS))
    out = pool.attend(q, SEQS, POSITIONS, window)
    torch.testing.assert_close(
        out.float(), pool.dense(q, SEQS, POSITIONS, window), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("window", [0, 20], ids=["full", "sliding-window"])
def test_every_token_has_the_same_bits_alone_and_in_any_batch(window: int) -> None:
    pool = Pool(9, 3, 64, seed=7)
    q = pool.queries(len(SEQS))
    together = pool.attend(q, SEQS, POSITIONS, window)
    for t in range(len(SEQS)):
        alone = pool.attend(q[t : t + 1], SEQS[t : t + 1], POSITIONS[t : t + 1], window)
        assert torch.equal(alone[0], together[t]), t
    # The chunk cut elsewhere (tokens 5..12 and 13..25) gives each token the same bits.
    first = pool.attend(q[5:13], SEQS[5:13], POSITIONS[5:13], window)
    rest = pool.attend(q[13:], SEQS[13:], POSITIONS[13:], window)
    assert torch.equal(torch.cat([first, rest]), together[5:])


def test_row_tiles_cut_runs_of_one_sequence_every_block_m_tokens() -> None:
    tiles = gpu_kernels.row_tiles([0, 1, 1, *[2] * 20, 1], CPU)
    assert tiles.seq.tolist() == [0, 1, 2, 2, 1]
    assert tiles.first.tolist() == [0, 1, 3, 3 + gpu_kernels.BLOCK_M, 23]
    assert tiles.rows.tolist() == [1, 2, gpu_kernels.BLOCK_M, 20 - gpu_kernels.BLOCK_M, 1]
