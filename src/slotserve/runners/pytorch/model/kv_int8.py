"""The int8 KV pool's rows (``--kv-cache-dtype int8``), as ``csrc/kernel_types.h`` states them:
a head's row of one position is its ``head_dim`` values as int8 codes, then their float32 scale
``max |x| / 127``, the codes ``rne(x · (127 / max |x|))``; read back, a value is ``code · scale``
rounded once to the model's dtype. Every row is its own: a sequence's cache does not depend on
its batch, so the mode keeps every invariance within it. Torch's operators write and read the
same bytes as the CPU kernels (``csrc/row_ops.cpp``, ``csrc/kv_rows.h``)."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 after the codes


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] as the pool's uint8 rows [..., head_dim + SCALE_BYTES]."""
    values = x.float()
    top = values.abs().amax(-1, keepdim=True)
    # A division, as the kernels' (torch's scalar / tensor multiplies by a reciprocal).
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    codes = torch.round(values * inverse).clamp(-127, 127).to(torch.int8)
    scale = (top / 127.0).contiguous()
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def values_of(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pool's uint8 rows [..., head_dim + SCALE_BYTES] read back as [..., head_dim]."""
    codes = rows[..., :-SCALE_BYTES].view(torch.int8)
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
