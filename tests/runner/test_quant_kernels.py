"""Projections whose weights stay quantized (csrc/quant_gemm.h): for every GGUF type served, the
codes and scales read back are gguf-py's own values; the kernel computes exactly the arithmetic
the kernel states (a torch reference of it, bit for bit); it is within bfloat16 rounding of the
float64 product with the file's true weights; and every row keeps its bits alone, in a batch and
on any thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.quant.formats import FORMATS, OwnType, QuantKind, block_size
from tests.runner.conftest import instruction_set, instruction_sets
from tests.runner.quant_reference import decode_rows, dequantized, reference_pack

KINDS = list(FORMATS)
LEGACY = {
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
}


def random_tensor(kind: QuantKind, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` rows of ``k`` weights in ``kind``: gguf-py's quantizer where it has one, else
    random blocks with plausible fp16 scales (every code and 6-bit scale value occurs)."""
    rng = np.random.default_rng(seed)
    if isinstance(kind, GGMLQuantizationType) and kind in LEGACY:
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    block, size = block_size(kind)
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)

    def fp16s() -> np.ndarray:
        return np.asarray(rng.uniform(1e-3, 4e-3, raw.shape[0]), dtype=np.float16).view(np.uint8)

    if kind == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = fp16s().reshape(-1, 2)
    elif kind == OwnType.Q4_ZP:  # zeros 0..16, as AWQ's and GPTQ's
        raw[:, 0:2], raw[:, 2:6] = fp16s().reshape(-1, 2), raw[:, 2:6] % 17
    else:
        raw[:, 0:2], raw[:, 2:4] = fp16s().reshape(-1, 2), fp16s().reshape(-1, 2)
    return raw.reshape(n, -1)


def fused(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a · b + c`` rounded once, as an FMA instruction rounds it: the product is exact
    in float64, the sum is rounded to odd there (its error from TwoSum decides the last bit),
    and a value rounded to odd with 53 bits rounds to float32 as the exact value would."""
    product = a.double() * b.double()
    total = product + c.double()
    virtual = total - product
    error = (product - (total - virtual)) + (c.double() - virtual)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.nextafter(total, total + torch.sign(error) * torch.inf)
    return torch.where((error != 0) & even, toward, total).float()


def stated_arithmetic(
    x: torch.Tensor, raw: np.ndarray, kind: QuantKind, n: int, bias: torch.Tensor
) -> torch.Tensor:
    """quant_gemm.h's arithmetic in torch: inputs rounded to integers of at most 127 per block of
    32, integer sums per sub-block, each sub-block's two fused float steps in input order
    (:func:`fused` rounds each as the instruction does)."""
    f, k, rows = FORMATS[kind], x.shape[1], x.shape[0]
    decoded = decode_rows(kind, raw, k)
    codes = decoded.codes.view(np.int8) if kind == GGMLQuantizationType.Q8_0 else decoded.codes
    values = torch.from_numpy(codes.astype(np.int64) - f.offset)
    blocks = x.float().reshape(rows, k // 32, 32)
    largest = blocks.abs().amax(-1)
    # A division (torch's scalar / tensor multiplies by a reciprocal, which rounds otherwise).
    scale = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    q = torch.round(blocks * scale[..., None]).clamp(-127, 127).to(torch.int64)
    step, qsum, q = largest / 127.0, q.sum(-1), q.reshape(rows, k)
    d = torch.from_numpy(decoded.d.astype(np.float32))
    sc = torch.from_numpy(decoded.sc.astype(np.float32))
    acc = torch.zeros(rows, n)
    for t in range(k // f.sub):
        first = t * f.sub
        block_sums = (q[:, first : first + f.sub] @ values[:, first : first + f.sub].T).float()
        weight_scale = d[:, first // f.super] * sc[:, t]
        factor = weight_scale[None, :] * step[:, first // 32, None]
        acc = fused(factor, block_sums, acc)
        if f.has_min:
            assert decoded.dmin is not None and decoded.m is not None
            minimum = torch.from_numpy(
                decoded.dmin[:, first // f.super].astype(np.float32) * decoded.m[:, t]
            )
            factor = minimum[None, :] * step[:, first // 32, None]
            acc = fused(-qsum[:, first // 32, None].float(), factor, acc)
    return (acc + bias.float()).bfloat16()


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_the_kernels_pack_the_reference_records_on_any_thread_count(
    kernels: CpuKernels, kind: QuantKind
) -> None:
    """quant_pack reads each type's bit layout as gguf-py's decoder does: its records are the
    reference packing's, byte for byte, a ragged last group's missing outputs zero; and each
    group writes its own records, so the thread count changes no byte."""
    n, k = 16 * 9 + 5, 512
    raw = random_tensor(kind, n, k, seed=7)
    expected = torch.from_numpy(reference_pack(kind, raw, k))
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            assert torch.equal(kernels.quant_pack(kind, raw, k), expected), count
    finally:
        torch.set_num_threads(threads)


def test_rows_packed_in_an_order_are_read_in_place(kernels: CpuKernels) -> None:
    """A permutation of a file's rows (llama.cpp's converter reorders q and k) is packed from
    the blocks where they lie: the records of the permuted copy, without the copy."""
    kind, n, k = GGMLQuantizationType.Q4_K, 40, 512
    raw = random_tensor(kind, n, k, seed=8)
    order = np.random.default_rng(9).permutation(n)
    expected = torch.from_numpy(reference_pack(kind, raw[order], k))
    assert torch.equal(kernels.quant_pack(kind, raw, k, order=order), expected)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.quant_pack(kind, raw, k, order=np.array([0, n]))


def test_blocks_the_packer_cannot_read_are_refused(kernels: CpuKernels) -> None:
    kind = GGMLQuantizationType.Q4_K
    raw = random_tensor(kind, 16, 256, seed=4)
    with pytest.raises(RuntimeError, match="whole blocks"):
        kernels.quant_pack(kind, raw[:, :100], 256)
    with pytest.raises(RuntimeError, match="records' size"):
        kernels.quant_pack(kind, raw, 256, out=torch.empty(10, dtype=torch.uint8))


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_codes_and_scales_read_back_are_the_files_values(kind: QuantKind) -> None:
    f, n, k = FORMATS[kind], 20, 512
    raw = random_tensor(kind, n, k, seed=1)
    decoded = decode_rows(kind, raw, k)
    codes = decoded.codes.view(np.int8) if kind == GGMLQuantizationType.Q8_0 else decoded.codes
    scale = np.repeat(decoded.d.astype(np.float64), f.super // f.sub, axis=1) * decoded.sc
    weights = np.repeat(scale, f.sub, axis=1) * (codes.astype(np.float64) - f.offset)
    if f.has_min:
        assert decoded.dmin is not None and decoded.m is not None
        minimum = np.repeat(decoded.dmin.astype(np.float64), f.super // f.sub, axis=1) * decoded.m
        weights -= np.repeat(minimum, f.sub, axis=1)
    np.testing.assert_allclose(weights, dequantized(raw, kind, n, k), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_the_kernel_computes_its_stated_arithmetic_for_every_row_alone_or_not(
    kernels: CpuKernels, threads: int, kind: QuantKind
) -> None:
    """40 outputs (two groups of 16 and a ragged one), 9 and 70 rows (tiles and a pass of
    rows, with remainders), with a bias; on every instruction set the CPU runs."""
    n, k = 40, 512
    raw = random_tensor(kind, n, k, seed=2)
    packed = kernels.quant_pack(kind, raw, k)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=gen).bfloat16()
    weights = torch.from_numpy(dequantized(raw, kind, n, k)).double()
    for rows in (9, 70):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        stated = stated_arithmetic(x, raw, kind, n, bias)
        true = x.double() @ weights.T + bias.double()
        for isa in instruction_sets(kernels):
            with instruction_set(kernels, isa):
                served = kernels.quant_linear(x, packed, FORMATS[kind], n, bias)
                assert torch.equal(served, stated), isa
                assert ((served.double() - true).abs().max() / true.abs().max()).item() < 8e-3
                for i in sorted({0, rows // 2, rows - 1}):
                    alone = kernels.quant_linear(x[i : i + 1], packed, FORMATS[kind], n, bias)
                    assert torch.equal(alone[0], served[i]), (isa, rows, i)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_rows_looked_up_are_the_dequantized_paths_values(
    kernels: CpuKernels, kind: QuantKind
) -> None:
    n, k = 40, 512
    raw = random_tensor(kind, n, k, seed=5)
    packed = kernels.quant_pack(kind, raw, k)
    rows = torch.tensor([39, 0, 17, 17, 5])
    looked_up = kernels.quant_rows(packed, rows, FORMATS[kind], n, k)
    values = torch.from_numpy(dequantized(raw, kind, n, k)).bfloat16()
    assert torch.equal(looked_up, values[rows])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.quant_rows(packed, torch.tensor([40]), FORMATS[kind], n, k)


def test_shapes_the_kernel_cannot_take_are_refused(kernels: CpuKernels) -> None:
    kind = GGMLQuantizationType.Q4_K
    packed = kernels.quant_pack(kind, random_tensor(kind, 16, 256, seed=4), 256)
    with pytest.raises(RuntimeError, match="super-blocks"):
        kernels.quant_linear(torch.ones(1, 288).bfloat16(), packed, FORMATS[kind], 16, None)
    with pytest.raises(RuntimeError, match="packed weight"):
        kernels.quant_linear(torch.ones(1, 256).bfloat16(), packed, FORMATS[kind], 48, None)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_prompt_rows_multiply_the_dequantized_weights_on_the_gemm(
    kernels: CpuKernels, threads: int, kind: QuantKind
) -> None:
    """Rows marked as a prompt's get ``linear``'s bits over the dequantized path's weights (so
    a prompt's tokens are ``--quantization none``'s), the others the integer arithmetic's, in
    any mix and alone; 40 outputs (a ragged group), 70 rows, a bias, every instruction set."""
    n, k, rows = 40, 512, 70
    raw = random_tensor(kind, n, k, seed=6)
    packed = kernels.quant_pack(kind, raw, k)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weights = torch.from_numpy(dequantized(raw, kind, n, k)).bfloat16()
    dense = kernels.linear(x, kernels.pack_weight(weights), bias.float(), n)
    integer = kernels.quant_linear(x, packed, FORMATS[kind], n, bias)
    prompt = torch.rand(rows, generator=gen) < 0.6
    for isa in instruction_sets(kernels):
        with instruction_set(kernels, isa):
            every = torch.ones(rows, dtype=torch.bool)
            all_prompt = kernels.quant_linear(x, packed, FORMATS[kind], n, bias, "", every)
            assert torch.equal(all_prompt, dense), isa
            mixed = kernels.quant_linear(x, packed, FORMATS[kind], n, bias, "", prompt)
            assert torch.equal(mixed[prompt], dense[prompt]), isa
            assert torch.equal(mixed[~prompt], integer[~prompt]), isa
            one = torch.ones(1, dtype=torch.bool)
            alone = kernels.quant_linear(x[3:4], packed, FORMATS[kind], n, bias, "", one)
            assert torch.equal(alone[0], dense[3]), isa
