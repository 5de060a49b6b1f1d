"""The matmul behind ``--batch-invariant`` on GPUs (runners/pytorch/gpu_matmul.py), run by
Triton's interpreter on the CPU: a row's outputs have the same bits whatever rows are beside it
(1 to 70 of them, across row tiles), and are F.linear's within the output's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slotserve.runners.pytorch import gpu_kernels
from slotserve.runners.pytorch.gpu_matmul import BLOCK_K, invariant_linear

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="Triton is not installed")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("depth", [BLOCK_K - 7, 3 * BLOCK_K + 5], ids=["one-k-tile", "k-tiles"])
def test_a_rows_outputs_are_its_own_and_linears(bias: bool, depth: int) -> None:
    gen = torch.Generator().manual_seed(depth)
    weight = torch.randn(150, depth, generator=gen).bfloat16()
    b = torch.randn(150, generator=gen).bfloat16() if bias else None
    x = torch.randn(70, depth, generator=gen).bfloat16()
    full = invariant_linear(x, weight, b)
    for rows in (1, 2, 31, 33, 64):
        assert torch.equal(invariant_linear(x[-rows:], weight, b), full[-rows:]), rows
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(full.float(), reference, atol=0.25, rtol=2**-7)


def test_float32_leading_dimensions_and_a_column_major_weight() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen)
    x = torch.randn(2, 3, 24, generator=gen)
    out = invariant_linear(x, weight)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    transposed = weight.T.contiguous().T  # the same values, column-major
    assert torch.equal(invariant_linear(x, transposed), out)
