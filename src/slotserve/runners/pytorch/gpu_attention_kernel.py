"""The Triton kernel behind ``gpu_kernels.paged_attention`` (that module states its invariance);
imported on its first call, so that a server on the CPU never loads Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _dot(a, b, exact: tl.constexpr):  # type: ignore[no-untyped-def]
    """``a @ b`` in float32: on the GPU's tensor cores from the inputs' bfloat16, or in
    exact float32 products (``exact``), which float32 models need (not TF32) and Triton's
    interpreter too: its bfloat16 ``dot`` reads the raw bits."""
    if exact:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit  # type: ignore[untyped-decorator]
def paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    tile_rows_ptr,
    positions_ptr,
    scale,
    window,
    stride_qt,
    stride_kr,
    stride_table,
    stride_ot,
    block_size: tl.constexpr,
    groups: tl.constexpr,
    group_pad: tl.constexpr,
    head_dim: tl.constexpr,
    dim_pad: tl.constexpr,
    kv_heads: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    exact_dots: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    n_rows = tl.load(tile_rows_ptr + tile)
    # Rows: token-major, the query heads of this KV head within each token.
    r = tl.arange(0, block_m * group_pad)
    token = first + r // group_pad
    group = r % group_pad
    row_ok = (r // group_pad < n_rows) & (group < groups)
    head = kv_head * groups + group
    d = tl.arange(0, dim_pad)
    d_ok = d < head_dim
    position = tl.load(positions_ptr + token, mask=row_ok, other=0)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * head_dim + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    last = tl.max(tl.where(row_ok, position, 0), axis=0)
    lowest = tl.min(tl.where(row_ok, position, last), axis=0)
    start = 0
    if window > 0:
        start = tl.maximum(lowest - window + 1, 0) // block_n * block_n
    m_i = tl.full([block_m * group_pad], float("-inf"), tl.float32)
    l_i = tl.zeros([block_m * group_pad], tl.float32)
    acc = tl.zeros([block_m * group_pad, dim_pad], tl.float32)
    for key0 in range(start, last + 1, block_n):
        n = key0 + tl.arange(0, block_n)
        in_pool = n <= last
        block = tl.load(tables_ptr + seq * stride_table + n // block_size, mask=in_pool, other=0)
        cache_row = block * block_size + n % block_size
        kv_offsets = cache_row[:, None] * stride_kr + kv_head * head_dim + d[None, :]
        kv_mask = in_pool[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), exact_dots) * scale
        visible = (n[None, :] <= position[:, None]) & row_ok[:, None]
        if window > 0:
            visible = visible & (n[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen nothing yet keeps m = -inf and its zeros (alpha scales
        # zeros, nothing is added) instead of turning into NaN: -inf less 0, never -inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m_i - m_safe)
        p = tl.where(visible, tl.exp(scores - m_safe[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, exact_dots)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * head_dim + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
