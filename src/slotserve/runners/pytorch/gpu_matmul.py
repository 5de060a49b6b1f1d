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

from slotserve.runners.pytorch.gpu_kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # the GPU extra is not installed
    triton = None

BLOCK_M = 32
BLOCK_N = 128
BLOCK_K = 64


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _matmul_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        rows,
        cols,
        depth,
        stride_x,
        stride_w,
        stride_out,
        has_bias: tl.constexpr,
        block_m: tl.constexpr,
        block_n: tl.constexpr,
        block_k: tl.constexpr,
        exact: tl.constexpr,
        by_sum: tl.constexpr,
    ):
        m = tl.program_id(0) * block_m + tl.arange(0, block_m)
        n = tl.program_id(1) * block_n + tl.arange(0, block_n)
        m_ok, n_ok = m < rows, n < cols
        acc = tl.zeros([block_m, block_n], tl.float32)
        for k0 in range(0, depth, block_k):
            k = k0 + tl.arange(0, block_k)
            k_ok = k < depth
            x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], m_ok[:, None] & k_ok[None, :])
            w = tl.load(w_ptr + n[None, :] * stride_w + k[:, None], n_ok[None, :] & k_ok[:, None])
            if by_sum:  # the interpreter: numpy's matmul sums by its BLAS's blocking, which
                # may depend on a row's place in the tile; a sum over K per output does not
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
            elif exact:  # float32 models: products in float32
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if has_bias:
            acc += tl.load(bias_ptr + n, n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + m[:, None] * stride_out + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            m_ok[:, None] & n_ok[None, :],
        )


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each output's reduction order fixed: ``x`` [..., K],
    ``weight`` [N, K] (row-major), ``bias`` [N]."""
    if triton is None:
        raise RuntimeError("--batch-invariant on a GPU needs Triton: pip install -e '.[gpu]'")
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
        _matmul_kernel[grid](
            rows, weight, bias if bias is not None else weight, out,
            rows.shape[0], cols, depth, rows.stride(0), weight.stride(0), out.stride(0),
            has_bias=bias is not None, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
            exact=x.dtype == torch.float32, by_sum=interpreted(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], cols)
