"""Quantized projections on AMX tiles (csrc/quant_amx.h): a step of whole 16-row tiles forms each
sub-block's integer sums with TDPBSUD, exact in int32, then scales them as the vector path does,
so every row keeps the vector path's bits, whichever path its step takes. The tile code runs on
every CPU with AVX512-BF16 over emulated tiles; on an AMX host the unit itself must give them."""

from __future__ import annotations

import pytest
import torch

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.quant.formats import FORMATS, QuantKind
from tests.runner.test_quant_kernels import random_tensor

KINDS = list(FORMATS)
# Too few rows for the tiles, whole tiles, whole tiles and a tail on the vector path, with K in
# several super-blocks (Q4_K's 256) and 40 outputs (two groups of 16 and a ragged one).
ROWS = (17, 64, 79, 128)


def _runs_tiles(kernels: CpuKernels, tiles: str) -> bool:
    default = kernels.quant_tiles
    try:
        kernels._m.select_quant_tiles(tiles)
    except RuntimeError:
        return False
    kernels._m.select_quant_tiles(default)
    return True


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_emulated_tiles_give_the_vector_paths_bits(
    kernels: CpuKernels, threads: int, kind: QuantKind
) -> None:
    if not _runs_tiles(kernels, "amx-emulated"):
        pytest.skip("no AVX512-BF16 with VNNI on this CPU: the tile code is not compiled here")
    n, k = 40, 512
    raw = random_tensor(kind, n, k, seed=11)
    packed = kernels.quant_pack(kind, raw, k)
    gen = torch.Generator().manual_seed(12)
    bias = torch.randn(n, generator=gen).bfloat16()
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16() * 3
        vector = kernels.quant_linear(x, packed, FORMATS[kind], n, bias, tiles="none")
        tiled = kernels.quant_linear(x, packed, FORMATS[kind], n, bias, tiles="amx-emulated")
        assert torch.equal(tiled, vector), rows


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_an_amx_host_sums_quantized_steps_on_its_unit_with_the_vector_paths_bits(
    kernels: CpuKernels, kind: QuantKind
) -> None:
    """Where AMX-INT8 is usable the unit serves by default (its sums were checked at load), and
    every row of a step of 17 to 600 rows, alone or not, keeps the vector path's bits."""
    if not kernels._m.runs_amx():
        pytest.skip("no AMX on this CPU (the emulated tiles are tested above)")
    assert kernels.quant_tiles == "amx", "AMX is here but its int8 sums differ from TDPBSUD's"
    n, k = 48, 1024
    raw = random_tensor(kind, n, k, seed=13)
    packed = kernels.quant_pack(kind, raw, k)
    gen = torch.Generator().manual_seed(14)
    for rows in (*ROWS, 600):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        served = kernels.quant_linear(x, packed, FORMATS[kind], n, None)
        assert torch.equal(served, kernels.quant_linear(x, packed, FORMATS[kind], n, None, "none"))
        alone = kernels.quant_linear(x[rows - 1 :], packed, FORMATS[kind], n, None)
        assert torch.equal(alone[0], served[-1]), rows


def test_unknown_tiles_are_refused(kernels: CpuKernels) -> None:
    kind = next(iter(FORMATS))
    packed = kernels.quant_pack(kind, random_tensor(kind, 16, 256, seed=4), 256)
    with pytest.raises(RuntimeError, match="unknown quantized tiles"):
        kernels.quant_linear(torch.ones(16, 256).bfloat16(), packed, FORMATS[kind], 16, None, "x")
