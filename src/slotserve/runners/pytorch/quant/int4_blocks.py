"""AWQ's and GPTQ's 4-bit weights as GGUF blocks the quantized kernels multiply, bit for bit.

Both store each weight as ``s · (q − z)``: ``q`` and ``z`` 4-bit integers, ``s`` an fp16 scale,
``z`` and ``s`` shared by a group of consecutive inputs of one output. A block of 32 inputs of
one group is then exactly a Q5_0 block, ``d · (code − 16)`` with ``d = s`` and ``code = q − z +
16`` (0..31); where every zero is 8 (GPTQ's symmetric checkpoints), exactly a Q4_0 block, ``d ·
(code − 8)`` with ``code = q``. The packing of each format is undone here; which checkpoints use
which is ``load/int4_checkpoint.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from slotserve.runners.pytorch.quant.tensor import QuantTensor

BLOCK = 32  # inputs of a Q4_0 / Q5_0 block
# AutoAWQ packs the eight outputs of a word in this order: nibble i holds output AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE_OF = tuple(AWQ_ORDER.index(j) for j in range(8))  # output j's nibble


@dataclass(frozen=True)
class Int4Weight:
    """One projection's weight as its integers: ``codes`` [out, in] (0..15), ``zeros`` [out,
    groups] and ``scales`` [out, groups] (fp16); input i belongs to group i // group_size."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.zeros.shape[1]

    def dense(self) -> torch.Tensor:
        """The weights in float32, ``s · (q − z)``: exact (an fp16 times an integer of 5 bits)."""
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)
        return (self.codes.to(torch.int16) - zeros).float() * scales

    def blocks(self) -> QuantTensor:
        """The same weights as Q4_0 blocks (every zero 8) or else Q5_0 blocks."""
        rows, k = self.codes.shape
        if self.group_size % BLOCK:
            raise ValueError(
                f"groups of {self.group_size} inputs: the quantized kernels take whole blocks of "
                f"{BLOCK} under one scale"
            )
        per_block = self.group_size // BLOCK
        d = self.scales.repeat_interleave(per_block, dim=1).contiguous()
        d_bytes = d.view(torch.uint8).numpy().reshape(rows, k // BLOCK, 2)
        if bool((self.zeros == 8).all()):
            kind, codes = GGMLQuantizationType.Q4_0, self.codes
        else:
            zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
            kind = GGMLQuantizationType.Q5_0
            codes = (self.codes.to(torch.int16) - zeros + 16).to(torch.uint8)
        values = codes.numpy().reshape(rows, k // BLOCK, BLOCK)
        # Bytes j of a block's nibbles: input j in the low half, input j + 16 in the high one.
        nibbles = (values[..., :16] & 15) | ((values[..., 16:] & 15) << 4)
        parts = [d_bytes, nibbles.astype(np.uint8)]
        if kind == GGMLQuantizationType.Q5_0:  # bit j of a little-endian word: input j's fifth
            high = ((values >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
            words = high.sum(axis=-1, dtype=np.uint32).astype("<u4")
            parts.insert(1, words.view(np.uint8).reshape(rows, k // BLOCK, 4))
        raw = np.concatenate(parts, axis=-1).reshape(rows, -1)
        return QuantTensor(kind, np.ascontiguousarray(raw), k)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] as their eight 4-bit fields [..., 8n], the lowest first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 15).flatten(-2).to(torch.uint8)


def _awq_outputs(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words [rows, out / 8] as codes [rows, out] in output order."""
    fields = nibbles(words).view(words.shape[0], -1, 8)
    return fields[..., list(_AWQ_NIBBLE_OF)].reshape(words.shape[0], -1)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """AutoAWQ's GEMM layout: ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] int32,
    eight outputs a word in ``AWQ_ORDER``; ``scales`` [groups, out]."""
    codes = _awq_outputs(qweight).t().contiguous()
    zeros = _awq_outputs(qzeros).t().to(torch.int16).contiguous()
    return Int4Weight(codes, zeros, _fp16(scales).t().contiguous())


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    zero_offset: int,
) -> Int4Weight:
    """GPTQ's layout: ``qweight`` [in / 8, out] int32, eight consecutive inputs a word;
    ``qzeros`` [groups, out / 8], eight outputs a word, each ``zero − zero_offset`` (1 in the
    original format, whose kernels add it back: a zero of 0 was stored as 15 and reads as 16;
    0 in ``gptq_v2``); ``g_idx`` [in], each input's group (act-order is refused)."""
    codes = nibbles(qweight.t().contiguous())
    outputs, k = codes.shape
    zeros = nibbles(qzeros)[:, :outputs].to(torch.int16) + zero_offset
    groups = zeros.shape[0]
    if g_idx is not None and not torch.equal(
        g_idx.to(torch.int64), torch.arange(k) // (k // groups)
    ):
        raise ValueError(
            "an act-order (desc_act) GPTQ checkpoint: its groups are not runs of consecutive "
            "inputs, which the quantized kernels need; use one quantized without desc_act"
        )
    return Int4Weight(codes, zeros.t().contiguous(), _fp16(scales).t().contiguous())


def _fp16(scales: torch.Tensor) -> torch.Tensor:
    half = scales.to(torch.float16)
    if not torch.equal(half.to(scales.dtype), scales):
        raise ValueError(f"the checkpoint's {scales.dtype} scales are not all fp16 values")
    return half
