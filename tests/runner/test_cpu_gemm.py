"""The projections' own GEMMs (csrc/gemm_vec.h, csrc/gemm_amx.h): every
row the same bits in any batch and on any thread count, within bfloat16 rounding of a float32
matmul; all but AMX's give vdpbf16ps' bits in input order, so every x86 host without AMX
computes alike. The AMX kernel's structure (tiles, padding, blocking, threads) runs on every CPU
over emulated tiles; on a CPU with AMX-BF16 the unit itself must give the emulation's bits."""

from __future__ import annotations

import pytest
import torch

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.model.layers import Projection


@pytest.fixture
def gemm(kernels: CpuKernels) -> CpuKernels:
    assert kernels.has_gemm, "the kernels serve a GEMM on every CPU they run on"
    return kernels


def _has_amx(kernels: CpuKernels) -> bool:
    return bool(kernels._m.runs_amx())


@pytest.mark.parametrize(
    ("outputs", "inputs"),
    [(960, 576), (576, 1536), (1100, 96), (49, 33), (40, 4500)],
    ids=["qkv", "down", "wide", "ragged", "inputs-in-panels"],
)
def test_the_gemm_gives_every_row_the_same_bits_in_any_batch(
    gemm: CpuKernels, threads: int, outputs: int, inputs: int
) -> None:
    """1-600 rows (tiles of 6 rows and 4 blocks, passes of 96 rows, and their remainders; an
    input longer than one panel; threads splitting the rows of narrow layers and the outputs of
    wide ones), with and without a bias, against each row alone; within
    bfloat16 rounding of a float32 matmul. On the GEMM this CPU serves with."""
    gen = torch.Generator().manual_seed(20 + outputs)
    weight = torch.randn(outputs, inputs, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    packed = gemm.pack_weight(weight)
    for rows in (1, 5, 64, 600):
        x = torch.randn(rows, inputs, generator=gen).bfloat16()
        for b in (None, bias):
            together = gemm.linear(x, packed, b, outputs)
            exact = x.float() @ weight.float().T + (b.float() if b is not None else 0)
            torch.testing.assert_close(together.float(), exact, atol=2e-2, rtol=8e-3)
            for i in torch.randperm(rows, generator=gen)[:7].tolist():
                alone = gemm.linear(x[i : i + 1], packed, b, outputs)
                assert torch.equal(alone[0], together[i]), (rows, i)


def _dot_pair_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps' arithmetic in torch: each output one float32 sum over the input pairs from
    k = 0 up, the odd element's product added before the even one's, each product exact (two
    bfloat16 fit float32) and each addition rounded once; then the bias, then one rounding."""
    acc = torch.zeros(x.shape[0], weight.shape[0])
    xs, ws = x.float(), weight.float()
    for kp in range(0, x.shape[1], 2):
        for k in (kp + 1, kp):
            acc = acc + xs[:, k : k + 1] * ws[:, k][None, :]
    return (acc + bias.float()).bfloat16()


@pytest.mark.parametrize("isa_gemm", ["avx2", "avx512", "avx512bf16"])
def test_the_gemms_but_amx_give_the_bits_of_vdpbf16ps_in_input_order(
    gemm: CpuKernels, threads: int, isa_gemm: str
) -> None:
    """Every GEMM of ours but AMX's computes each output exactly as the reference above: an
    AVX2 host's projections give an AVX512-BF16 host's bits."""
    if not gemm._m.runs_gemm(isa_gemm):
        pytest.skip(f"this CPU does not run the {isa_gemm} GEMM")
    gen = torch.Generator().manual_seed(40)
    weight = torch.randn(40, 96, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(9, 96, generator=gen).bfloat16()
    served = gemm.linear_on(isa_gemm, x, gemm.pack_weight(weight), bias, 40)
    assert torch.equal(served, _dot_pair_reference(x, weight, bias))


def test_a_projection_serves_through_the_gemm_once_packed(gemm: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(30)
    projection = Projection(1536, 200, bias=True, dtype=torch.bfloat16)
    projection.weight.data = torch.randn(200, 1536, generator=gen).bfloat16()
    projection.bias.data = torch.randn(200, generator=gen).bfloat16()
    x = torch.randn(3, 4, 1536, generator=gen).bfloat16()
    before = projection(x)
    projection.pack(gemm)
    after = projection(x)
    assert after.shape == (3, 4, 200) and projection.weight.numel() == 0
    torch.testing.assert_close(after, before, atol=5e-2, rtol=1.6e-2)


# Shapes with K a multiple of 32 (the AMX kernel's): row tiles of 16 in groups of 32 and their
# padded remainders, block pairs and a lone or ragged block, one or many tiles of K.
AMX_SHAPES = [(96, 576), (49, 64), (40, 1536)]
AMX_ROWS = (1, 16, 17, 45)


@pytest.mark.parametrize(("outputs", "inputs"), AMX_SHAPES, ids=["qkv", "ragged", "down"])
def test_the_amx_kernel_over_emulated_tiles_is_batch_invariant_and_close(
    gemm: CpuKernels, threads: int, outputs: int, inputs: int
) -> None:
    gen = torch.Generator().manual_seed(40 + outputs)
    weight = torch.randn(outputs, inputs, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    packed = gemm.pack_weight(weight)
    for rows in AMX_ROWS:
        x = torch.randn(rows, inputs, generator=gen).bfloat16()
        for b in (None, bias):
            together = gemm.linear_on("amx-emulated", x, packed, b, outputs)
            exact = x.float() @ weight.float().T + (b.float() if b is not None else 0)
            torch.testing.assert_close(together.float(), exact, atol=2e-2, rtol=8e-3)
            for i in sorted({0, rows - 1, rows // 2}):
                alone = gemm.linear_on("amx-emulated", x[i : i + 1], packed, b, outputs)
                assert torch.equal(alone[0], together[i]), (rows, i)


def test_the_amx_kernel_takes_only_whole_tiles_of_inputs(gemm: CpuKernels) -> None:
    packed = gemm.pack_weight(torch.ones(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemm.linear_on("amx-emulated", torch.ones(2, 48).bfloat16(), packed, None, 16)


def test_amx_serves_exactly_where_the_unit_gives_its_documented_bits(gemm: CpuKernels) -> None:
    """Without AMX-BF16 the AVX512-BF16 GEMM serves and AMX cannot be chosen. With it, the
    load-time check must have passed (the unit computes what the SDM says TDPBF16PS computes),
    so AMX serves; the tests below then hold it to the emulation on every shape."""
    if not _has_amx(gemm):
        assert gemm.gemm == ("avx512bf16" if gemm._m.runs_gemm("avx512bf16") else gemm.isa)
        with pytest.raises(RuntimeError, match="does not run the amx GEMM"):
            gemm.select_gemm("amx")
        return
    assert gemm.gemm == "amx", "AMX-BF16 is here but its bits differ from its documented ones"


@pytest.mark.parametrize(("outputs", "inputs"), AMX_SHAPES, ids=["qkv", "ragged", "down"])
def test_the_amx_unit_gives_the_emulations_bits_and_every_row_its_own(
    gemm: CpuKernels, threads: int, outputs: int, inputs: int
) -> None:
    if not _has_amx(gemm):
        pytest.skip("no AMX-BF16 on this CPU (the emulated kernel is tested above)")
    gen = torch.Generator().manual_seed(50 + outputs)
    weight = torch.randn(outputs, inputs, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    packed = gemm.pack_weight(weight)
    for rows in (*AMX_ROWS, 600):
        x = torch.randn(rows, inputs, generator=gen).bfloat16()
        together = gemm.linear_on("amx", x, packed, bias, outputs)
        if rows <= 45:
            emulated = gemm.linear_on("amx-emulated", x, packed, bias, outputs)
            assert torch.equal(together, emulated), rows
        for i in sorted({0, rows - 1, rows // 2}):
            alone = gemm.linear_on("amx", x[i : i + 1], packed, bias, outputs)
            assert torch.equal(alone[0], together[i]), (rows, i)
