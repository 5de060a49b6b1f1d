"""Attention on AMX tiles (``csrc/attend_amx.h``): on a CPU whose AMX unit gives its documented
bits every partition of a model whose head_dim is a multiple of 32 runs in the tiles' own
arithmetic: on the unit, or for a lone decode row of the common shapes the same sums in vector
code (``csrc/attend_amx_row.h``). Here the tiles are emulated in scalar code (the same kernel
code, on any CPU with AVX512-BF16), held to the vector arithmetic's contract:
close to dense attention, and every row bit-identical alone, in any batch, chunked or not, on
one thread or two, from a bfloat16 or an int8 pool. On an AMX host the unit must give the
emulation's bits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from slotserve.engine.runner_interface import Runner
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from tests.runner import test_cpu_kernels as vector_tests
from tests.runner import test_kv_int8 as int8_tests
from tests.runner import test_runner_behaviour as engine_tests
from tests.runner.conftest import attention_arithmetic

TILE_SHAPES = [(9, 3, 64), (16, 8, 128), (32, 8, 128), (8, 2, 256), (14, 2, 64), (4, 4, 64)]


@pytest.fixture
def tiles(kernels: CpuKernels) -> Iterator[CpuKernels]:
    """The kernels with attention on emulated AMX tiles."""
    if kernels.isa != "avx512bf16":
        pytest.skip(f"the tile code is compiled for AVX512-BF16 only; this CPU runs {kernels.isa}")
    with attention_arithmetic(kernels, "amx-emulated"):
        yield kernels


def test_tiles_match_dense_attention(tiles: CpuKernels) -> None:
    for window in (0, 37):
        vector_tests.test_attention_matches_dense_attention(tiles, window)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), TILE_SHAPES)
def test_tiles_are_exact_and_batch_invariant_for_each_head_shape(
    tiles: CpuKernels, heads: int, kv_heads: int, dim: int
) -> None:
    vector_tests.test_other_head_shapes_are_exact_and_batch_invariant(tiles, heads, kv_heads, dim)


def test_every_row_on_tiles_is_bit_identical_alone_and_in_any_batch(
    tiles: CpuKernels, threads: int
) -> None:
    vector_tests.test_every_row_is_bit_identical_alone_and_in_any_batch(tiles, threads)


def test_decode_rows_sharing_a_prefix_on_tiles_are_bit_identical_alone(
    tiles: CpuKernels, threads: int
) -> None:
    vector_tests.test_decode_rows_sharing_a_cached_prefix_are_bit_identical_alone(tiles, threads)


def test_a_prefill_chunk_on_tiles_equals_its_tokens_one_by_one(
    tiles: CpuKernels, threads: int
) -> None:
    vector_tests.test_a_prefill_chunk_equals_its_tokens_one_by_one(tiles, threads)


# The shapes whose lone rows run the tiles' arithmetic in vector code (kernel_types.h's
# SLOTSERVE_ATTENTION_SHAPES): groups 1-6 at head_dim 64, 1-4 at 128, 1 at 256.
ROW_SHAPES = [(2 * g, 2, 64) for g in range(1, 7)] + [(2 * g, 2, 128) for g in range(1, 5)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [*ROW_SHAPES, (2, 2, 256)])
@pytest.mark.parametrize("pool_dtype", ["bf16", "int8"])
def test_a_lone_row_has_the_bits_of_its_row_in_a_tile(
    tiles: CpuKernels, heads: int, kv_heads: int, dim: int, pool_dtype: str
) -> None:
    """A lone row sums the tiles' products in vector code (attend_amx_row.h): one KV head at a
    time within a partition, every KV head at once past one, an int8 pool's rows in place.
    Each position alone has the bits it has inside a prefill chunk on the tiles."""
    gen = torch.Generator().manual_seed(heads * dim)
    pool = vector_tests._Pool([700], seed=dim + heads, kv_heads=kv_heads, dim=dim)
    keys, values = pool.keys, pool.values
    if pool_dtype == "int8":
        keys, values, _ = int8_tests._int8_pool(pool)
    positions = [*range(100, 120), *range(660, 681)]  # two chunks: within, past a partition

    def attend(q: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return int8_tests._attend(tiles, keys, values, pool, q, [0] * len(rows), rows, 0)

    q = torch.randn(len(positions), heads, dim, generator=gen).bfloat16()
    chunks = attend(q, positions)
    for i in range(0, len(positions), 4):
        assert torch.equal(attend(q[i : i + 1], [positions[i]])[0], chunks[i]), positions[i]


def test_tiles_over_int8_rows_are_attention_over_their_values(
    tiles: CpuKernels, threads: int
) -> None:
    int8_tests.test_attention_over_int8_rows_is_attention_over_their_values(
        tiles, threads, 32, 8, 128
    )


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_the_served_model_on_tiles_gives_each_request_its_tokens_alone(
    tiles: CpuKernels, torch_runner: Runner, prefix_cache: bool
) -> None:
    """SmolLM2 (head_dim 64) under the engine with every attention call on the tiles: greedy
    tokens alone and batched, the prefix cache off and on."""
    engine_tests.test_greedy_tokens_are_identical_alone_and_batched(torch_runner, prefix_cache)


def test_a_long_prefill_on_tiles_leaves_a_decoding_neighbour_as_it_was(
    tiles: CpuKernels, torch_runner: Runner
) -> None:
    engine_tests.test_long_prefill_arriving_beside_a_decoding_sequence_changes_nothing(torch_runner)


def test_the_tiles_differ_from_the_vector_arithmetic_in_last_bits_only(
    tiles: CpuKernels,
) -> None:
    """The two arithmetics sum in other orders: the same attention within rounding, and rows of
    a head_dim that is not a multiple of 32 (no whole tile of pairs) keep the vector one."""
    gen = torch.Generator().manual_seed(21)
    for dim, on_tiles in ((128, True), (80, False)):
        pool = vector_tests._Pool([700, 333], seed=dim, kv_heads=2, dim=dim)
        q = torch.randn(50, 8, dim, generator=gen).bfloat16()
        seqs, positions = [0] * 40 + [1] * 10, list(range(600, 640)) + list(range(323, 333))
        on = pool.attend(tiles, q, seqs, positions)
        with attention_arithmetic(tiles, "vector"):
            off = pool.attend(tiles, q, seqs, positions)
        torch.testing.assert_close(on.float(), off.float(), atol=8e-3, rtol=8e-3)
        if not on_tiles:
            assert torch.equal(on, off)


def test_an_amx_host_serves_attention_on_its_unit_with_the_emulations_bits(
    kernels: CpuKernels,
) -> None:
    """Where the unit passes the GEMM's check and gives the emulation's bits on a small
    attention problem, attention runs on it; then it must give them on a real batch too, and
    to lone decode rows (keys read in place as A tiles, a partial last block copied)."""
    if not kernels._m.runs_amx():
        assert kernels.attention == "vector"
        with pytest.raises(RuntimeError, match="does not run attention on amx"):
            kernels.select_attention("amx")
        pytest.skip("no AMX-BF16 here: the unit's bits are checked on an AMX host")
    assert kernels.attention == "amx", "AMX-BF16 is here but its attention bits differ"
    gen = torch.Generator().manual_seed(22)
    pool = vector_tests._Pool([900, 40], seed=5, kv_heads=8, dim=128)
    q = torch.randn(36, 32, 128, generator=gen).bfloat16()
    seqs, positions = [0] * 33 + [1] * 3, [*range(800, 833), 37, 38, 39]
    real = pool.attend(kernels, q, seqs, positions)
    with attention_arithmetic(kernels, "amx-emulated"):
        assert torch.equal(pool.attend(kernels, q, seqs, positions), real)
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        pool = vector_tests._Pool([1000, 600], seed=6, kv_heads=kv_heads, dim=dim)
        q = torch.randn(2, heads, dim, generator=gen).bfloat16()
        real = pool.attend(kernels, q, [0, 1], [999, 583])
        with attention_arithmetic(kernels, "amx-emulated"):
            assert torch.equal(pool.attend(kernels, q, [0, 1], [999, 583]), real)
        with attention_arithmetic(kernels, "vector"):
            close = pool.attend(kernels, q, [0, 1], [999, 583])
        torch.testing.assert_close(real.float(), close.float(), atol=8e-3, rtol=8e-3)
