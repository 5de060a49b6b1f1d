"""The GGUF quantization types (and one of our own) the CPU kernels multiply as stored
(csrc/quant_gemm.h states the arithmetic, csrc/quant_pack.cpp reads each type's blocks into its
records).

Every weight of these types is ``scale · (code − offset) − min`` with ``scale = d · sc`` and
``min = dmin · m`` per sub-block: ``d`` and ``dmin`` fp16 per super-block, ``sc`` and ``m``
small integers per sub-block.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GROUP = 16  # outputs a record holds


@dataclass(frozen=True)
class QuantFormat:
    """What csrc/quant_format.h's ``QuantFormat`` holds, and where GGUF keeps each part."""

    bits: int  # of a code: 4, 5, 6 or 8
    offset: int  # subtracted from a code
    has_min: bool
    sub: int  # inputs per sub-block (one sc, m)
    super: int  # inputs per super-block (one d, dmin)

    @property
    def sub_scales(self) -> bool:
        """Whether a record holds ``sc`` and ``m``: only with sub-blocks, where they vary (a
        32-input type's are all one, so its records leave them out)."""
        return self.sub != self.super

    @property
    def record_bytes(self) -> int:
        """One group of 16 outputs over one super-block, packed (csrc/quant_pack.cpp)."""
        per_output = 2 if self.has_min else 1  # d (and dmin); sc (and m) per sub-block
        subs = self.super // self.sub if self.sub_scales else 0
        header = 32 * per_output + 16 * subs * per_output
        pairs = self.super // 2
        if self.bits == 8:
            return header + pairs * 32
        high = {5: pairs // 4 * 16, 6: pairs // 4 * 32}.get(self.bits, 0)  # the high bits
        return header + pairs * 16 + high

    def packed_bytes(self, rows: int, k: int) -> int:
        """The records of ``rows`` outputs over ``k`` inputs: whole groups of 16 outputs."""
        return -(-rows // GROUP) * (k // self.super) * self.record_bytes


class OwnType(IntEnum):
    """Block types of our own, for weights no GGUF type holds exactly (ids past ggml's)."""

    # Per 128 inputs: an fp16 scale s, a uint8 zero z per 32 inputs, then each 32's nibbles as
    # Q4_0's: s · (q − z), AWQ's and GPTQ's weights (``int4_blocks.py``).
    Q4_ZP = 1024


QuantKind = GGMLQuantizationType | OwnType

# Inputs and bytes of one block of each own type, as gguf-py's GGML_QUANT_SIZES states ggml's.
OWN_SIZES = {OwnType.Q4_ZP: (128, 70)}


def block_size(kind: QuantKind) -> tuple[int, int]:
    """Inputs and bytes of one of ``kind``'s blocks."""
    return OWN_SIZES[kind] if isinstance(kind, OwnType) else GGML_QUANT_SIZES[kind]


FORMATS: dict[QuantKind, QuantFormat] = {
    GGMLQuantizationType.Q4_0: QuantFormat(4, 8, False, 32, 32),
    GGMLQuantizationType.Q4_1: QuantFormat(4, 0, True, 32, 32),
    GGMLQuantizationType.Q5_0: QuantFormat(5, 16, False, 32, 32),
    GGMLQuantizationType.Q5_1: QuantFormat(5, 0, True, 32, 32),
    GGMLQuantizationType.Q8_0: QuantFormat(8, 0, False, 32, 32),
    GGMLQuantizationType.Q4_K: QuantFormat(4, 0, True, 32, 256),
    GGMLQuantizationType.Q5_K: QuantFormat(5, 0, True, 32, 256),
    GGMLQuantizationType.Q6_K: QuantFormat(6, 32, False, 16, 256),
    OwnType.Q4_ZP: QuantFormat(4, 0, True, 32, 128),
}
