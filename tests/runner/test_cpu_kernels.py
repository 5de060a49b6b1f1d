"""The PyTorch runner's C++ CPU kernels (``cpu_kernels.py``) against the plain-torch path they
replace, and their contract: every row of a call is bit-identical to the same row computed
alone, with one thread and with two, whatever else the call holds, and on every instruction set
(how the runner loads and serves them is in test_cpu_kernel_builds.py).

Tolerances against the reference: the norms, the residual add and SiLU·mul round as the torch
operators do (asserted equal up to one bfloat16 step, and equal in the large majority of
elements); attention keeps its scores in float32 where the reference rounds them to bfloat16,
and rounds the probabilities to bfloat16 as the reference does, so it is compared with bfloat16
tolerances to a float32 dense reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slotserve.runners.pytorch.cpu_kernels import (
    CpuKernels,
)
from slotserve.runners.pytorch.model.layers import RmsNorm
from slotserve.runners.pytorch.model.rotary import apply_rotary
from tests.runner.conftest import attention_arithmetic, instruction_set, instruction_sets

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two same-signed bfloat16 tensors are, element-wise."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    apart = _ulps_apart(out, ref)
    assert apart.max().item() <= 1, "at most one bfloat16 step from the torch operators"
    assert (apart == 0).float().mean().item() > 0.95


@pytest.mark.parametrize("plus_one", [False, True], ids=["llama-norm", "gemma-norm"])
def test_norms_match_the_torch_module(kernels: CpuKernels, plus_one: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=gen).bfloat16()
    residual = torch.randn(37, 576, generator=gen).bfloat16()
    norm = RmsNorm(576, 1e-5, plus_one, torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=gen).bfloat16()
    _close_to_reference(kernels.rms_norm(x, norm.weight, 1e-5, plus_one), norm(x))
    normed, summed = kernels.add_rms_norm(x, residual, norm.weight, 1e-5, plus_one)
    assert torch.equal(summed, residual + x)
    _close_to_reference(normed, norm(residual + x))


def test_silu_mul_matches_the_torch_operators(kernels: CpuKernels) -> None:
    gate_up = (torch.randn(29, 2 * 1537, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    _close_to_reference(kernels.silu_mul(gate_up), F.silu(gate) * up)


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, plus_one: bool) -> torch.Tensor:
    norm = RmsNorm(x.shape[-1], 1e-6, plus_one, torch.bfloat16)
    norm.weight.data = weight
    return norm(x)  # type: ignore[no-any-return]


def rotary_inputs(
    gen: torch.Generator, tokens: int, q_cols: int, rotary_dim: int
) -> tuple[torch.Tensor, ...]:
    """qkv rows, cos and sin tables of 64 positions, each token's position and its distinct
    cache row among 40: rotary_write's inputs."""
    qkv = torch.randn(tokens, q_cols + 2 * KV_HEADS * DIM, generator=gen).bfloat16()
    angles = torch.rand(64, rotary_dim // 2, generator=gen) * 6
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    positions = torch.randint(0, 64, (tokens,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(40, generator=gen)[:tokens].int()
    return qkv, cos, sin, positions, rows


@pytest.mark.parametrize(
    ("gated", "qk_norm", "rotary_dim"),
    [(False, False, DIM), (False, True, DIM), (True, True, DIM // 2)],
    ids=["llama", "qwen3-qk-norm", "qwen3.5-gated-partial-rotary"],
)
def test_rotary_write_matches_the_torch_path_and_fills_the_pool(
    kernels: CpuKernels, gated: bool, qk_norm: bool, rotary_dim: int
) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = 11
    q_cols = HEADS * DIM * (2 if gated else 1)
    qkv, cos, sin, positions, rows = rotary_inputs(gen, tokens, q_cols, rotary_dim)
    key_cache = torch.zeros(40, KV_HEADS, DIM, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    q_norm = torch.randn(DIM, generator=gen).bfloat16() if qk_norm else None
    k_norm = torch.randn(DIM, generator=gen).bfloat16() if qk_norm else None
    q = kernels.rotary_write(
        qkv, cos, sin, positions, rows, key_cache, value_cache, HEADS, KV_HEADS, DIM, gated,
        q_norm, k_norm, 1e-6, gated,
    )  # fmt: skip

    if gated:
        query = qkv[:, :q_cols].view(tokens, HEADS, 2 * DIM)[..., :DIM]
    else:
        query = qkv[:, :q_cols].view(tokens, HEADS, DIM)
    key = qkv[:, q_cols : q_cols + KV_HEADS * DIM].view(tokens, KV_HEADS, DIM)
    value = qkv[:, q_cols + KV_HEADS * DIM :].view(tokens, KV_HEADS, DIM)
    if q_norm is not None and k_norm is not None:
        query, key = _norm_reference(query, q_norm, gated), _norm_reference(key, k_norm, gated)
    table = cos[positions.long()], sin[positions.long()]
    # The reference rounds each rotary operator to bfloat16; the kernel rounds once.
    torch.testing.assert_close(q, apply_rotary(query, *table), atol=3e-2, rtol=1.6e-2)
    torch.testing.assert_close(
        key_cache[rows.long()], apply_rotary(key, *table), atol=3e-2, rtol=1.6e-2
    )
    assert torch.equal(value_cache[rows.long()], value)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows.long()] = False
    assert not key_cache[untouched].any() and not value_cache[untouched].any()


class _Pool:
    """Sequences of the given lengths in scattered blocks of one pool, with their contexts."""

    def __init__(
        self,
        lengths: list[int],
        seed: int,
        kv_heads: int = KV_HEADS,
        dim: int = DIM,
        shared: list[int] | None = None,
    ) -> None:
        """``shared``: per sequence, how many leading positions it holds in the blocks of the
        sequences before it (a whole number of blocks: what the prefix cache shares)."""
        gen = torch.Generator().manual_seed(seed)
        blocks = sum(-(-n // BLOCK) for n in lengths) + 3
        self.dim = dim
        self.keys = torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen).bfloat16()
        self.values = torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen).bfloat16()
        free = torch.randperm(blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for i, n in enumerate(lengths):
            common = self.tables[i - 1][: (shared[i] if shared else 0) // BLOCK] if i else []
            self.tables.append(common + [free.pop() for _ in range(-(-n // BLOCK) - len(common))])
        width = max(len(t) for t in self.tables)
        self.block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32
        )

    def rows(self, seq: int, length: int) -> torch.Tensor:
        table = self.tables[seq]
        return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])

    def attend(
        self,
        kernels: CpuKernels,
        q: torch.Tensor,
        seqs: list[int],
        positions: list[int],
        window: int = 0,
    ) -> torch.Tensor:
        return kernels.paged_attention(
            q.contiguous(), self.keys, self.values, self.block_tables,
            torch.tensor(seqs, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32),
            BLOCK, window, 1 / math.sqrt(self.dim),
        )  # fmt: skip


def _dense(pool: _Pool, q: torch.Tensor, seq: int, position: int, window: int) -> torch.Tensor:
    """Float32 attention of one query row over its sequence's positions up to ``position``."""
    rows = pool.rows(seq, position + 1)
    first = max(0, position - window + 1) if window else 0
    group = q.shape[0] // pool.keys.shape[1]
    keys = pool.keys[rows[first:]].float().repeat_interleave(group, dim=1)
    values = pool.values[rows[first:]].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", q.float(), keys) / math.sqrt(pool.dim)
    return torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1)


@pytest.mark.parametrize("window", [0, 37], ids=["full", "sliding-window"])
def test_attention_matches_dense_attention(kernels: CpuKernels, window: int) -> None:
    lengths = [1, 15, 17, 300, 1029]
    pool = _Pool(lengths, seed=4)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(5))
    q = q.bfloat16()
    positions = [n - 1 for n in lengths]
    out = pool.attend(kernels, q, list(range(len(lengths))), positions, window)
    for i, position in enumerate(positions):
        expected = _dense(pool, q[i], i, position, window)
        torch.testing.assert_close(out[i].float(), expected, atol=1e-2, rtol=1.6e-2)


def test_every_row_is_bit_identical_alone_and_in_any_batch(
    kernels: CpuKernels, threads: int
) -> None:
    """Random batches (1-600 rows: decode tokens and prefill chunks of sequences whose lengths
    are not multiples of a block or a partition) against each row computed alone."""
    gen = torch.Generator().manual_seed(6 + threads)
    lengths = [int(n) for n in torch.randint(1, 1400, (24,), generator=gen)]
    pool = _Pool(lengths, seed=7)
    for rows_in_batch in (1, 2, 7, 64, 600):  # 2: few rows, their partitions spread
        seqs = torch.randint(0, len(lengths), (rows_in_batch,), generator=gen).tolist()
        positions = [int(torch.randint(0, lengths[s], (1,), generator=gen)) for s in seqs]
        q = torch.randn(rows_in_batch, HEADS, DIM, generator=gen).bfloat16()
        for window in (0, 100):
            together = pool.attend(kernels, q, seqs, positions, window)
            for i in torch.randperm(rows_in_batch, generator=gen)[:12].tolist():
                alone = pool.attend(kernels, q[i : i + 1], [seqs[i]], [positions[i]], window)
                assert torch.equal(alone[0], together[i]), (rows_in_batch, i, positions[i])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [
        (16, 8, 128),
        (32, 8, 128),
        (8, 2, 256),
        (14, 2, 64),
        (12, 2, 64),
        (4, 4, 64),
        (4, 2, 80),
        (6, 6, 48),
    ],
    ids=[
        "qwen3",
        "llama-3.1-8b",
        "qwen3.5",
        "group-7",
        "group-6",
        "no-grouping-64",
        "pairs-in-part-of-a-vector",
        "no-grouping",
    ],
)
def test_other_head_shapes_are_exact_and_batch_invariant(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int
) -> None:
    """Prefill chunks (tiles of consecutive positions) beside decode rows, against dense
    attention and against each row alone, for head sizes and groupings beside SmolLM2's."""
    gen = torch.Generator().manual_seed(heads * dim)
    pool = _Pool([40, 700, 333], seed=dim, kv_heads=kv_heads, dim=dim)
    rows = [(1, p) for p in range(250, 290)] + [(0, 39), (2, 332)] + [(2, p) for p in range(3)]
    seqs, positions = [s for s, _ in rows], [p for _, p in rows]
    q = torch.randn(len(rows), heads, dim, generator=gen).bfloat16()
    for window in (0, 30):
        together = pool.attend(kernels, q, seqs, positions, window)
        for i, (seq, position) in enumerate(rows):
            alone = pool.attend(kernels, q[i : i + 1], [seq], [position], window)
            assert torch.equal(alone[0], together[i]), (window, seq, position)
            expected = _dense(pool, q[i], seq, position, window)
            torch.testing.assert_close(together[i].float(), expected, atol=1e-2, rtol=1.6e-2)


def test_decode_rows_sharing_a_cached_prefix_are_bit_identical_alone(
    kernels: CpuKernels, threads: int
) -> None:
    """Decode rows whose sequences hold a prefix in the same blocks read its whole partitions
    together (one tile of rows from several sequences): each row against itself alone, against
    dense attention, beside a prefill chunk of one of them, and with sequences that share a
    partition only in part (different blocks: not read together)."""
    gen = torch.Generator().manual_seed(11 + threads)
    # Sequences 1 and 2 hold their first 1,040 positions (four partitions and a bit) in the
    # blocks of the one before, 3 and 4 their first 272 (one partition and a bit), 5 none.
    lengths = [1300, 1100, 1290, 700, 1250, 600]
    pool = _Pool(lengths, seed=12, shared=[0, 1040, 1040, 272, 272, 0])
    rows = [(s, n - 1) for s, n in enumerate(lengths)]
    chunk = [(2, p) for p in range(1200, 1240)]
    for batch in (rows, rows + chunk, rows[:2], rows[1:4]):
        seqs, positions = [s for s, _ in batch], [p for _, p in batch]
        q = torch.randn(len(batch), HEADS, DIM, generator=gen).bfloat16()
        together = pool.attend(kernels, q, seqs, positions)
        for i, (seq, position) in enumerate(batch):
            alone = pool.attend(kernels, q[i : i + 1], [seq], [position])
            assert torch.equal(alone[0], together[i]), (len(batch), seq, position)
            expected = _dense(pool, q[i], seq, position, 0)
            torch.testing.assert_close(together[i].float(), expected, atol=1e-2, rtol=1.6e-2)


def test_a_prefill_chunk_equals_its_tokens_one_by_one(kernels: CpuKernels, threads: int) -> None:
    """A chunk's rows against the same positions decoded one at a time (the grain-1 property
    the engine's chunking relies on)."""
    pool = _Pool([700], seed=8)
    q = torch.randn(300, HEADS, DIM, generator=torch.Generator().manual_seed(9)).bfloat16()
    positions = list(range(400, 700))
    chunk = pool.attend(kernels, q, [0] * 300, positions)
    for i in range(0, 300, 23):
        assert torch.equal(pool.attend(kernels, q[i : i + 1], [0], [positions[i]])[0], chunk[i])


def test_per_row_kernels_are_batch_invariant(kernels: CpuKernels, threads: int) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(600, 576, generator=gen).bfloat16()
    residual = torch.randn(600, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    gate_up = torch.randn(600, 3072, generator=gen).bfloat16()
    normed, _ = kernels.add_rms_norm(x, residual, weight, 1e-5, False)
    activated = kernels.silu_mul(gate_up)
    for i in (0, 17, 599):
        alone, _ = kernels.add_rms_norm(x[i : i + 1], residual[i : i + 1], weight, 1e-5, False)
        assert torch.equal(alone[0], normed[i])
        assert torch.equal(kernels.silu_mul(gate_up[i : i + 1])[0], activated[i])


def test_out_of_range_metadata_is_refused_not_read(kernels: CpuKernels) -> None:
    pool = _Pool([20], seed=11)
    q = torch.randn(1, HEADS, DIM).bfloat16()
    with pytest.raises(RuntimeError, match="position past its table"):
        pool.attend(kernels, q, [0], [40])
    with pytest.raises(RuntimeError, match="sequence out of range"):
        pool.attend(kernels, q, [3], [5])


def test_a_call_without_tokens_returns_no_rows(kernels: CpuKernels) -> None:
    pool = _Pool([20], seed=11)
    out = pool.attend(kernels, torch.zeros(0, HEADS, DIM).bfloat16(), [], [])
    assert out.shape == (0, HEADS * DIM)


def test_every_instruction_set_gives_the_same_bits(kernels: CpuKernels) -> None:
    """One source, three builds: AVX512-BF16 (attention's dot products in one instruction),
    AVX-512 and AVX2 (the same dot products as two fused steps, AVX2 in 256-bit halves) must
    compute the same bits, denormal inputs included (the instruction flushes them; the other
    builds run attention with DAZ and FTZ)."""
    runs = instruction_sets(kernels)
    if len(runs) < 2:
        pytest.skip("the CPU runs one instruction set only")
    gen = torch.Generator().manual_seed(12)
    pool = _Pool([5, 300, 700], seed=13)
    # Denormal bfloat16 in every attention operand, and sharp scores whose small probabilities
    # times small values fall below float32's normal range.
    tiny = torch.rand(pool.values.shape, generator=gen) < 0.05
    pool.values[tiny] = (torch.randn(int(tiny.sum()), generator=gen) * 1e-39).bfloat16()
    pool.keys[torch.rand(pool.keys.shape, generator=gen) < 0.05] = 1e-39
    q = (torch.randn(40, HEADS, DIM, generator=gen) * 6).bfloat16()
    q[torch.rand(q.shape, generator=gen) < 0.05] = -1e-39
    seqs = torch.randint(0, 3, (40,), generator=gen).tolist()
    positions = [int(torch.randint(0, [5, 300, 700][s], (1,), generator=gen)) for s in seqs]
    x = torch.randn(40, 576, generator=gen).bfloat16()
    residual = torch.randn(40, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    gate_up = torch.randn(40, 3072, generator=gen).bfloat16()

    def run() -> list[torch.Tensor]:
        return [
            pool.attend(kernels, q, seqs, positions),
            pool.attend(kernels, q, seqs, positions, window=50),
            *kernels.add_rms_norm(x, residual, weight, 1e-5, False),
            kernels.silu_mul(gate_up),
        ]

    results = {}
    for isa in runs:  # the vector arithmetic (AMX tiles sum otherwise: test_cpu_attention_amx.py)
        with instruction_set(kernels, isa), attention_arithmetic(kernels, "vector"):
            results[isa] = run()
    for isa in runs[1:]:
        for a, b in zip(results[runs[0]], results[isa], strict=True):
            assert torch.equal(a, b), isa


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (32, 8, 64), (32, 8, 128), (8, 2, 256), (12, 2, 64), (16, 8, 128), (4, 4, 64)],
    ids=["smollm2", "llama-3.2-1b", "llama-3.1-8b", "qwen3.5", "group-6", "qwen3", "no-grouping"],
)
def test_lone_long_rows_give_the_same_bits_on_every_instruction_set(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int
) -> None:
    """A decode row alone past one partition reads each partition for every KV head at once
    (attend_heads.h, one kernel per instruction set): its bits on every set, against the same
    row beside others (read head by head), and against dense attention."""
    runs = instruction_sets(kernels)
    if len(runs) < 2:
        pytest.skip("the CPU runs one instruction set only")
    lengths = [1300, 700, 257]
    gen = torch.Generator().manual_seed(heads + dim)
    pool = _Pool(lengths, seed=dim, kv_heads=kv_heads, dim=dim)
    rows = [(0, 1299), (1, 699), (2, 256), (0, 511)]
    q = (torch.randn(len(rows), heads, dim, generator=gen) * 3).bfloat16()
    results: dict[str, list[torch.Tensor]] = {}
    for isa in runs:
        with instruction_set(kernels, isa), attention_arithmetic(kernels, "vector"):
            together = pool.attend(kernels, q, [s for s, _ in rows], [p for _, p in rows])
            alone = [
                pool.attend(kernels, q[i : i + 1], [seq], [position])[0]
                for i, (seq, position) in enumerate(rows)
            ]
        for i, row in enumerate(alone):
            assert torch.equal(row, together[i]), (isa, rows[i])
        results[isa] = alone
    for isa in runs[1:]:
        for i, (a, b) in enumerate(zip(results[runs[0]], results[isa], strict=True)):
            assert torch.equal(a, b), (isa, rows[i])
    for i, (seq, position) in enumerate(rows):
        expected = _dense(pool, q[i], seq, position, 0)
        torch.testing.assert_close(results[runs[0]][i].float(), expected, atol=1e-2, rtol=1.6e-2)
