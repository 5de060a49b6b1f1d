"""An HF folder of 4-bit AWQ or GPTQ weights (``config.json``'s ``quantization_config``): each
quantized projection's packed tensors (``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``)
read together as its one weight, kept as the exact GGUF blocks of ``quant/int4_blocks.py`` for
the quantized kernels, or dequantized for a dense load. Other quantization methods are refused
by name before any weight is read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.quant.int4_blocks import Int4Weight, awq_weight, gptq_weight
from slotserve.runners.pytorch.quant.tensor import QuantTensor

METHODS = ("awq", "gptq")
_PACKED = ("qweight", "qzeros", "scales")
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format: the offset its zeros are stored at


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # awq or gptq
    zero_offset: int = 0  # GPTQ: what the stored zeros lack

    @property
    def kinds(self) -> set[str]:
        """The GGUF types its projections may become (Q4_0 where every zero is 8)."""
        return {"Q4_0", "Q5_0"}

    def weight(self, parts: Mapping[str, torch.Tensor]) -> Int4Weight:
        if self.method == "awq":
            return awq_weight(parts["qweight"], parts["qzeros"], parts["scales"])
        return gptq_weight(
            parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), self.zero_offset
        )


def int4_scheme(raw_config: Mapping[str, Any]) -> Int4Scheme | None:
    """The folder's 4-bit scheme, None for unquantized weights; ``UnsupportedModelError`` for a
    quantization this runner does not read."""
    q = raw_config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedModelError(
            f"{method or 'unnamed'} quantized checkpoints are not served; AWQ and GPTQ 4-bit "
            "ones are, and GGUF files"
        )
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"{bits}-bit {method.upper()} weights: only 4-bit are served")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("zero_point", True) is False:
            raise UnsupportedModelError(
                f"AWQ's {version} layout{'' if q.get('zero_point', True) else ' without zeros'}: "
                "only the GEMM layout with zero points is read"
            )
        return Int4Scheme("awq")
    layout = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if layout not in _GPTQ_FORMATS:
        raise UnsupportedModelError(
            f"GPTQ's {layout} checkpoint format: only {' and '.join(_GPTQ_FORMATS)} are read"
        )
    return Int4Scheme("gptq", _GPTQ_FORMATS[layout])


def int4_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], scheme: Int4Scheme, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """``tensors`` with each quantized projection's packed tensors replaced by its
    ``<name>.weight``: GGUF blocks with ``keep_quantized``, else dense float32."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in (*_PACKED, "g_idx"):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in _PACKED):
            weight = scheme.weight(pending.pop(prefix))
            yield f"{prefix}.weight", weight.blocks() if keep_quantized else weight.dense()
    # A g_idx read after its projection (another shard) can only be checked, not applied.
    for prefix, parts in pending.items():
        if set(parts) != {"g_idx"}:
            missing = sorted(set(_PACKED) - set(parts))
            raise ValueError(f"the checkpoint's {prefix} lacks its {', '.join(missing)}")
        g_idx = parts["g_idx"]
        if bool((g_idx[1:] < g_idx[:-1]).any()):
            raise ValueError(f"{prefix}: an act-order (desc_act) GPTQ checkpoint is not served")
