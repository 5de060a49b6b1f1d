"""The int8 KV pool (``--kv-cache-dtype int8``, ``model/kv_int8.py``): the CPU kernels read a
pool of int8 rows exactly as a bfloat16 pool holding those rows' values (so every invariance of
the kernels carries over), write the rows torch's operators write, and the rows keep each value
within half a step of its scale. The runner-level invariance tests run on an int8 runner too
(``conftest.py``: the ``torch-int8-kv`` kind)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.runner_interface import Runner
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.kv_int8 import SCALE_BYTES, int8_rows, values_of
from slotserve.runners.pytorch.runner import TorchRunner
from tests.runner.conftest import instruction_set, instruction_sets, require_batch_invariance
from tests.runner.engine_runs import alone_then_together, generate, greedy
from tests.runner.test_cpu_kernels import BLOCK, DIM, HEADS, KV_HEADS, _Pool, rotary_inputs

PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,")


def test_rows_keep_each_value_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4, 64, generator=gen) * torch.rand(300, 4, 1, generator=gen) * 8
    x = torch.cat([x, torch.zeros(1, 4, 64)]).bfloat16()  # an all-zero row: scale 0
    rows = int8_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (301, 4, 64 + SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.float().abs().amax(-1, keepdim=True) / 127)
    back = values_of(rows, torch.float32)
    assert ((back - x.float()).abs() <= scale * 0.5001).all()  # float roundings aside
    assert not back[-1].any()
    assert torch.equal(values_of(rows, torch.bfloat16), back.bfloat16())


def _int8_pool(pool: _Pool) -> tuple[torch.Tensor, torch.Tensor, _Pool]:
    """The pool's K and V as int8 rows, and a bfloat16 pool of what those rows hold."""
    keys, values = int8_rows(pool.keys), int8_rows(pool.values)
    held = _Pool.__new__(_Pool)
    held.__dict__.update(pool.__dict__)
    held.keys, held.values = values_of(keys, torch.bfloat16), values_of(values, torch.bfloat16)
    return keys, values, held


def _attend(
    kernels: CpuKernels,
    keys: torch.Tensor,
    values: torch.Tensor,
    pool: _Pool,
    q: torch.Tensor,
    seqs: list[int],
    positions: list[int],
    window: int,
) -> torch.Tensor:
    return kernels.paged_attention(
        q.contiguous(), keys, values, pool.block_tables, torch.tensor(seqs, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int32), BLOCK, window, 1 / math.sqrt(pool.dim),
    )  # fmt: skip


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(HEADS, KV_HEADS, DIM), (32, 8, 128)])
def test_attention_over_int8_rows_is_attention_over_their_values(
    kernels: CpuKernels, threads: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Decode rows, a prefill chunk and rows sharing a cached prefix, with and without a
    window, on every instruction set: bit for bit what the bfloat16 pool of the same values
    gives (the bfloat16 kernels' tests then hold for the int8 pool)."""
    gen = torch.Generator().manual_seed(heads + threads)
    lengths = [1300, 1100, 700, 45]
    pool = _Pool(lengths, seed=dim, kv_heads=kv_heads, dim=dim, shared=[0, 1040, 272, 0])
    keys, values, held = _int8_pool(pool)
    rows = [(s, n - 1) for s, n in enumerate(lengths)] + [(2, p) for p in range(600, 640)]
    seqs, positions = [s for s, _ in rows], [p for _, p in rows]
    q = torch.randn(len(rows), heads, dim, generator=gen).bfloat16()
    for isa in instruction_sets(kernels):
        with instruction_set(kernels, isa):
            for window in (0, 100):
                int8 = _attend(kernels, keys, values, pool, q, seqs, positions, window)
                bf16 = held.attend(kernels, q, seqs, positions, window)
                assert torch.equal(int8, bf16), (isa, window)
                alone = _attend(kernels, keys, values, pool, q[:1], seqs[:1], positions[:1], window)
                assert torch.equal(alone[0], int8[0])


def test_the_kernels_write_the_rows_torch_writes(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv, cos, sin, positions, rows = rotary_inputs(gen, 11, HEADS * DIM, DIM)

    def write(caches: tuple[torch.Tensor, ...]) -> torch.Tensor:
        keys, values = caches
        return kernels.rotary_write(
            qkv, cos, sin, positions, rows, keys, values, HEADS, KV_HEADS, DIM, False, None, None,
            1e-6, False,
        )  # fmt: skip

    bf16 = tuple(torch.zeros(40, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in "kv")
    int8 = tuple(torch.zeros(40, KV_HEADS, DIM + SCALE_BYTES, dtype=torch.uint8) for _ in "kv")
    assert torch.equal(write(int8), write(bf16))
    for written, reference in zip(int8, bf16, strict=True):
        assert torch.equal(written[rows.long()], int8_rows(reference[rows.long()]))
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[rows.long()] = False
        assert not written[untouched].any()
    with pytest.raises(RuntimeError, match="caches"):
        write((int8[0], bf16[1]))


def test_torch_operators_serve_an_int8_pool_batch_invariant(
    model_path: Path, torch_runner: Runner, torch_int8_kv_runner: Runner
) -> None:
    """Without the CPU kernels the pool's rows are written and read by torch's operators: a
    sequence's greedy tokens alone are its tokens beside others, and its first is the int8
    kernels' first. A position costs (head_dim + 4) / (2 · head_dim) of a bfloat16 one."""
    runner = TorchRunner(
        TorchLoadConfig(
            model_path, num_slots=4, max_model_len=1024, cpu_kernels=False, kv_cache_dtype="int8"
        )
    )
    try:
        require_batch_invariance(runner)
        prompts = [runner.tokenizer.encode(text) for text in PROMPTS]
        core = EngineCore(runner, EngineConfig(num_slots=4))
        alone, together = alone_then_together(core, prompts, greedy(16), {"p1": ("p0", 5)})
        assert alone == together
        kernels = generate(
            EngineCore(torch_int8_kv_runner, EngineConfig(num_slots=4)),
            {"p0": (prompts[0], greedy(16))},
        )
        assert kernels["p0"][0] == alone["p0"][0]
        bf16, int8 = (r.model_info.kv_bytes_per_token for r in (torch_runner, runner))
        assert int8 * 2 * 64 == bf16 * (64 + SCALE_BYTES)  # SmolLM2's head_dim: 64
    finally:
        runner.close()
