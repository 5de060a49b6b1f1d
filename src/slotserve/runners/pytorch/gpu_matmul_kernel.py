"""The Triton kernel behind ``gpu_matmul.invariant_linear`` (that module states its order);
imported on its first call, so that a server on the CPU never loads Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def matmul_kernel(  # type: ignore[no-untyped-def]
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
