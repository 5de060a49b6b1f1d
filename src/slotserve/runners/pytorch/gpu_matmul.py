"""A matmul for ``--batch-invariant`` on GPUs: every output sums its products in the same order
whatever the number of rows, so a sequence's projections (and logits) do not depend on its
batch, as the CPU kernels' GEMM already guarantees on CPUs.

cuBLAS picks a kernel, and with it the reduction's split along K, by the problem's shape: a
row computed in a batch of 64 can differ in its last bits from the same row alone (what
Thinking Machines' ``batch_invariant_ops`` and vLLM's ``VLLM_BATCH_INVARIANT`` replace). Here
the tile sizes are constants, never chosen by shape: each program owns a ``BLOCK_M`` × ``BLOCK_N``
tile of the output and walks K from 0 upwards in steps of ``BLOCK_K``, accumulating in float32;
an output's sum depends on K and the weights alone. Rows past M are masked, never computed
with another order.

Tested on the CPU under ``TRITON_INTERPRET=1`` (``tests/runner/test_gpu_matmul.py``).
"""

from __future__ import annotations

import torch

from slotserve.runners.pytorch.gpu_kernels import available, interpreted

BLOCK_M = 32
BLOCK_N = 128
BLOCK_K = 64


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each output's reduction order fixed: ``x`` [..., K],
    ``weight`` [N, K] (row-major), ``bias`` [N]."""
    if not available():
        raise RuntimeError("--batch-invariant on a GPU needs Triton: pip install -e '.[gpu]'")
    import triton

    from slotserve.runners.pytorch.gpu_matmul_kernel import matmul_kernel

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:  # the kernel reads each weight row as contiguous K
        weight = weight.contiguous()
    depth = rows.shape[1]
    cols = weight.shape[0]
    out = torch.empty(rows.shape[0], cols, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], BLOCK_M), triton.cdiv(cols, BLOCK_N))
        matmul_kernel[grid](
            rows, weight, bias if bias is not None else weight, out,
            rows.shape[0], cols, depth, rows.stride(0), weight.stride(0), out.stride(0),
            has_bias=bias is not None, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
            exact=x.dtype == torch.float32, by_sum=interpreted(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], cols)
