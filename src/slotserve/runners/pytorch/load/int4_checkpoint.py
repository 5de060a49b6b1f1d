"""An HF folder of 4-bit AWQ, GPTQ or compressed-tensors (llm-compressor's W4A16) weights
(``config.json``'s ``quantization_config``): each quantized projection's packed tensors
(``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``; ``weight_packed``, ``weight_scale``...)
read together as its one weight, kept as the exact blocks of ``quant/int4_blocks.py`` for
the quantized kernels, or dequantized for a dense load. Other quantizations are refused by name
before any weight is read."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.runners.options import STORED_QUANTIZATIONS
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.quant.int4_blocks import (
    Int4Weight,
    awq_weight,
    gptq_weight,
    packed_weight,
)
from slotserve.runners.pytorch.quant.tensor import QuantTensor

logger = logging.getLogger(__name__)
METHODS = STORED_QUANTIZATIONS  # quant_method's names, as --quantization takes them
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format: the offset its zeros are stored at
# Each method's tensors of one projection: those it always has, then those it may have.
_PARTS = {
    "awq": (("qweight", "qzeros", "scales"), ()),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "compressed-tensors": (
        ("weight_packed", "weight_scale", "weight_shape"),
        ("weight_zero_point", "weight_g_idx"),
    ),
}


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # one of METHODS
    zero_offset: int = 0  # GPTQ: what the stored zeros lack
    symmetric: bool = True  # compressed-tensors: no zero points stored

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors of one projection, every one it has."""
        always, maybe = _PARTS[self.method]
        return always + maybe

    def complete(self, parts: Mapping[str, torch.Tensor]) -> bool:
        """Whether a projection's tensors are all in (in a shard's order, any optional ones
        that sort first: a GPTQ ``g_idx``; compressed-tensors' zero points sort last)."""
        zero_points = self.method == "compressed-tensors" and not self.symmetric
        needed = _PARTS[self.method][0] + (("weight_zero_point",) if zero_points else ())
        return all(p in parts for p in needed)

    @property
    def kinds(self) -> set[str]:
        """The block types its projections may become (``int4_blocks.py`` says which when)."""
        return {"Q4_0", "Q4_ZP", "Q5_0"}

    def weight(self, parts: Mapping[str, torch.Tensor]) -> Int4Weight:
        if self.method == "awq":
            return awq_weight(parts["qweight"], parts["qzeros"], parts["scales"])
        if self.method == "compressed-tensors":
            return packed_weight(
                parts["weight_packed"],
                parts["weight_scale"],
                parts.get("weight_zero_point"),
                parts.get("weight_g_idx"),
            )
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
            f"{method or 'unnamed'} quantized checkpoints are not served; 4-bit AWQ, GPTQ and "
            "compressed-tensors ones are, and GGUF files"
        )
    if method == "compressed-tensors":
        return _compressed_tensors(q)
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


def _compressed_tensors(q: Mapping[str, Any]) -> Int4Scheme:
    """llm-compressor's ``pack-quantized`` 4-bit integer weights (W4A16: the activations are
    the kernels' own 8-bit rounding either way), by group or by channel."""
    layout = str(q.get("format", "")).lower()
    groups = list((q.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if layout != "pack-quantized" or not weights:
        raise UnsupportedModelError(
            f"compressed-tensors' {layout or 'unnamed'} format: only pack-quantized is read"
        )
    for w in weights:
        kind = f"{w.get('num_bits')}-bit {w.get('type')} {w.get('strategy')}"
        if (w.get("num_bits"), w.get("type")) != (4, "int") or w.get("strategy") not in (
            "group",
            "channel",
        ):
            raise UnsupportedModelError(
                f"compressed-tensors' {kind} weights: only 4-bit int by group or channel are read"
            )
    symmetric = all(w.get("symmetric", True) for w in weights)
    return Int4Scheme("compressed-tensors", symmetric=symmetric)


def int4_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], scheme: Int4Scheme, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """``tensors`` with each quantized projection's packed tensors replaced by its
    ``<name>.weight``: blocks with ``keep_quantized`` (but for act-order groups, which the load
    rounds to Q8_0 as any dense matrix), else dense float32."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    act_order_said = False
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in scheme.parts:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if scheme.complete(parts):
            weight = scheme.weight(pending.pop(prefix))
            if keep_quantized and not weight.in_runs and not act_order_said:
                act_order_said = True
                logger.warning(
                    "act-order (desc_act) weights: no block holds their groups, so they are "
                    "dequantized and rounded to Q8_0 (about twice the bytes a weight)"
                )
            kept = keep_quantized and weight.in_runs
            yield f"{prefix}.weight", weight.blocks() if kept else weight.dense()
    if pending:  # a projection's tensors split across shards, or missing
        prefix, parts = next(iter(pending.items()))
        missing = [p for p in _PARTS[scheme.method][0] if p not in parts] or ["other tensors"]
        raise ValueError(f"the checkpoint's {prefix} lacks its {', '.join(missing)}")
