"""AWQ's, GPTQ's and compressed-tensors' 4-bit weights as blocks the quantized kernels multiply,
bit for bit.

Each stores a weight as ``s · (q − z)``: ``q`` and ``z`` 4-bit integers, ``s`` an fp16 scale,
``z`` and ``s`` shared by a group of consecutive inputs of one output. A block of 32 inputs of
one group is then exactly a Q4_0 block, ``d · (code − 8)`` with ``d = s`` and ``code = q``, where
every zero is 8 (symmetric checkpoints); else 128 inputs of one group are exactly a block
of our Q4_ZP (``formats.py``: Q4_0's nibbles with a zero per 32, multiplied as Q4_K's sub-blocks
are); groups of 32 or 64 are exactly Q5_0 blocks, ``d · (code − 16)`` with ``code = q − z + 16``
(0..31), a bit more a weight. The packing of each format is undone here; which checkpoints use
which is ``load/int4_checkpoint.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from slotserve.runners.pytorch.quant.formats import OwnType, QuantKind, block_size
from slotserve.runners.pytorch.quant.tensor import QuantTensor

BLOCK = 32  # inputs of a Q4_0 / Q5_0 block
ZP_BLOCK = block_size(OwnType.Q4_ZP)[0]
# AutoAWQ packs the eight outputs of a word in this order: nibble i holds output AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Int4Weight:
    """One projection's weight as its integers: ``codes`` [out, in] (0..15), ``zeros`` [out,
    groups] and ``scales`` [out, groups] (fp16); input i belongs to group i // group_size, or
    with act-order (GPTQ's ``desc_act``) to group ``group_of[i]``."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_of: torch.Tensor | None = None

    @property
    def in_runs(self) -> bool:
        """Whether each group is a run of consecutive inputs, as blocks need."""
        return self.group_of is None

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.zeros.shape[1]

    def dense(self) -> torch.Tensor:
        """The weights in float32, ``s · (q − z)``: exact (an fp16 times an integer of 5 bits)."""
        if self.group_of is None:
            zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
            scales = self.scales.float().repeat_interleave(self.group_size, dim=1)
        else:
            zeros, scales = self.zeros[:, self.group_of], self.scales.float()[:, self.group_of]
        return (self.codes.to(torch.int16) - zeros).float() * scales

    def blocks(self) -> QuantTensor:
        """The same weights as Q4_0 blocks (every zero 8), else Q4_ZP blocks (groups of 128·n
        inputs), else Q5_0 blocks."""
        if not self.in_runs:
            raise ValueError("act-order groups are not runs of inputs: no block holds them")
        if self.group_size % BLOCK:
            raise ValueError(
                f"groups of {self.group_size} inputs: the quantized kernels take whole blocks of "
                f"{BLOCK} under one scale"
            )
        rows, k = self.codes.shape
        zeros = self.zeros.repeat_interleave(self.group_size // BLOCK, dim=1)  # [rows, k / 32]
        d = self.scales.repeat_interleave(self.group_size // BLOCK, dim=1).contiguous()
        d_bytes = d.view(torch.uint8).numpy().reshape(rows, k // BLOCK, 2)
        codes = self.codes.numpy().reshape(rows, k // BLOCK, BLOCK)
        if bool((zeros == 8).all()):
            kind: QuantKind = GGMLQuantizationType.Q4_0
            parts = [d_bytes, _nibbles_of(codes)]
        elif self.group_size % ZP_BLOCK == 0:
            kind, per = OwnType.Q4_ZP, ZP_BLOCK // BLOCK
            zero_bytes = zeros.to(torch.uint8).numpy().reshape(rows, k // ZP_BLOCK, per)
            nibbles = _nibbles_of(codes).reshape(rows, k // ZP_BLOCK, per * 16)
            parts = [d_bytes[:, ::per], zero_bytes, nibbles]
        else:
            kind = GGMLQuantizationType.Q5_0
            steps = codes.astype(np.int16) - zeros.numpy()[..., None] + 16
            # Bit j of a little-endian word: input j's fifth.
            high = ((steps >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
            words = high.sum(axis=-1, dtype=np.uint32).astype("<u4")
            high_bytes = words.view(np.uint8).reshape(rows, k // BLOCK, 4)
            parts = [d_bytes, high_bytes, _nibbles_of(steps.astype(np.uint8))]
        raw = np.concatenate(parts, axis=-1).reshape(rows, -1)
        return QuantTensor(kind, np.ascontiguousarray(raw), k)


def _nibbles_of(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes as a Q4_0 block's 16 bytes: byte j holds input j in its low nibble and
    input 16 + j in its high one."""
    return ((codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)).astype(np.uint8)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] as their eight 4-bit fields [..., 8n], the lowest first (a
    little-endian word's bytes in order, each low nibble first)."""
    octets = words.contiguous().view(torch.uint8)
    return torch.stack((octets & 15, octets >> 4), dim=-1).flatten(-2)


def _awq_outputs(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words [rows, out / 8] as codes [out, rows] in output order: nibble 4e + c of a
    word holds its output 2c + e (``AWQ_ORDER``), so one permutation of the fields orders them
    and transposes them."""
    rows, words_a_row = words.shape
    fields = nibbles(words).view(rows, words_a_row, 2, 4)  # [rows, word, e, c]
    return fields.permute(1, 3, 2, 0).reshape(words_a_row * 8, rows)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """AutoAWQ's GEMM layout: ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] int32,
    eight outputs a word in ``AWQ_ORDER``; ``scales`` [groups, out]."""
    codes = _awq_outputs(qweight)
    zeros = _awq_outputs(qzeros).to(torch.int16)
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
    0 in ``gptq_v2``); ``g_idx`` [in], each input's group (act-order's kept as ``group_of``)."""
    codes = nibbles(qweight.t().contiguous())
    outputs, k = codes.shape
    zeros = nibbles(qzeros)[:, :outputs].to(torch.int16) + zero_offset
    group_of = None if g_idx is None else _act_order(g_idx, k, zeros.shape[0])
    return Int4Weight(codes, zeros.t().contiguous(), _fp16(scales).t().contiguous(), group_of)


def packed_weight(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> Int4Weight:
    """compressed-tensors' ``pack-quantized``: ``packed`` [out, in / 8] int32, eight
    consecutive inputs a word, each value stored plus 8; ``zero_points`` (asymmetric) [out / 8
    rounded up, groups], eight outputs a word, each plus 8 too; ``scales`` [out, groups]."""
    codes = nibbles(packed)
    outputs, k = codes.shape
    groups = scales.shape[1]
    if zero_points is None:  # symmetric: w = s · (stored − 8)
        zeros = torch.full((outputs, groups), 8, dtype=torch.int16)
    else:
        zeros = nibbles(zero_points.t().contiguous())[:, :outputs].t().to(torch.int16)
    group_of = None if g_idx is None else _act_order(g_idx, k, groups)
    return Int4Weight(codes, zeros.contiguous(), _fp16(scales).contiguous(), group_of)


def _act_order(g_idx: torch.Tensor, k: int, groups: int) -> torch.Tensor | None:
    """``g_idx`` (each input's group) where it is act-order's, None where groups are runs."""
    group_of = g_idx.to(torch.int64)
    return None if torch.equal(group_of, torch.arange(k) // (k // groups)) else group_of


def _fp16(scales: torch.Tensor) -> torch.Tensor:
    """The scales as the kernels' fp16: exact for fp16 scales, and for bfloat16 ones from fp16's
    smallest normal (2^-14) up; a smaller one (an all-but-zero group's) moves its weights by
    under 2^-20 when rounded, and is."""
    half = scales.to(torch.float16)
    inexact = half.to(scales.dtype) != scales
    if bool((inexact & (scales.abs() >= 2**-14)).any()):
        raise ValueError(f"the checkpoint's {scales.dtype} scales are not all fp16 values")
    return half
