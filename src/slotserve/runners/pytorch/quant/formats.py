"""The GGUF quantization types the CPU kernels multiply as stored, and how a tensor of each is
read into integer codes and scales (csrc/quant_gemm.h states the arithmetic).

Every weight of these types is ``scale · (code − offset) − min`` with ``scale = d · sc`` and
``min = dmin · m`` per sub-block: ``d`` and ``dmin`` fp16 per super-block, ``sc`` and ``m``
small integers per sub-block. The codes are read with gguf-py's own decoder, over blocks whose
scales are set to one and whose minimums to zero: the decoding of each type's bit layout is
then gguf-py's, not a second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

_ONE = np.array([1.0], dtype=np.float16).view(np.uint8)
_ZERO = np.array([0.0], dtype=np.float16).view(np.uint8)
# Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums: every scale 1, every minimum 0.
_K_UNIT_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)


@dataclass(frozen=True)
class QuantFormat:
    """What csrc/quant_format.h's ``QuantFormat`` holds, and where GGUF keeps each part."""

    bits: int  # of a code as packed: 4, 5 or 8
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
        """One group of 16 outputs over one super-block, packed (packing.py)."""
        per_output = 2 if self.has_min else 1  # d (and dmin); sc (and m) per sub-block
        subs = self.super // self.sub if self.sub_scales else 0
        header = 32 * per_output + 16 * subs * per_output
        pairs = self.super // 2
        if self.bits == 8:
            return header + pairs * 32
        high = pairs // 4 * 16 if self.bits == 5 else 0
        return header + pairs * 16 + high


FORMATS: dict[GGMLQuantizationType, QuantFormat] = {
    GGMLQuantizationType.Q4_0: QuantFormat(4, 8, False, 32, 32),
    GGMLQuantizationType.Q4_1: QuantFormat(4, 0, True, 32, 32),
    GGMLQuantizationType.Q5_0: QuantFormat(5, 16, False, 32, 32),
    GGMLQuantizationType.Q5_1: QuantFormat(5, 0, True, 32, 32),
    GGMLQuantizationType.Q8_0: QuantFormat(8, 0, False, 32, 32),
    GGMLQuantizationType.Q4_K: QuantFormat(4, 0, True, 32, 256),
    GGMLQuantizationType.Q5_K: QuantFormat(5, 0, True, 32, 256),
    # Six-bit codes widened to a byte each at load (a quarter more bytes than the file's): the
    # kernels stream bytes at the read rate, while pulling six bits apart costs more than that.
    GGMLQuantizationType.Q6_K: QuantFormat(8, 32, False, 16, 256),
}


@dataclass
class Decoded:
    """Rows of a quantized tensor as integers and scales: ``codes`` [rows, k] uint8 (int8 for
    Q8_0, stored as its bytes), ``d`` and ``dmin`` [rows, k / super] fp16, ``sc`` [rows, k / sub]
    int8 and ``m`` [rows, k / sub] uint8 (``dmin`` and ``m`` None without a minimum)."""

    codes: np.ndarray
    d: np.ndarray
    sc: np.ndarray
    dmin: np.ndarray | None = None
    m: np.ndarray | None = None


def decode_rows(kind: GGMLQuantizationType, raw: np.ndarray, k: int) -> Decoded:
    """``raw``: rows of GGUF blocks ([rows, k / block · type size] uint8, as gguf-py's reader
    gives a quantized tensor)."""
    block, size = GGML_QUANT_SIZES[kind]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows * (k // block), size)
    unit = blocks.copy()
    f = FORMATS[kind]
    if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        unit[:, 0:2], unit[:, 2:4], unit[:, 4:16] = _ONE, _ZERO, _K_UNIT_SCALES
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        decoded = Decoded(
            _codes(unit, kind, f),
            _f16(blocks[:, 0:2]),
            sc.astype(np.int8),
            _f16(blocks[:, 2:4]),
            m.astype(np.uint8),
        )
    elif kind == GGMLQuantizationType.Q6_K:
        unit[:, 192:208], unit[:, 208:210] = 1, _ONE
        sc6 = blocks[:, 192:208].view(np.int8)
        decoded = Decoded(_codes(unit, kind, f), _f16(blocks[:, 208:210]), sc6)
    else:  # one 32-input block per super-block: d first, then (Q4_1, Q5_1) the minimum
        unit[:, 0:2] = _ONE
        ones = np.ones((blocks.shape[0], 1), dtype=np.int8)
        if f.has_min:  # w = d · q + m: a minimum of −m, once
            unit[:, 2:4] = _ZERO
            minimum = -_f16(blocks[:, 2:4])
            decoded = Decoded(
                _codes(unit, kind, f), _f16(blocks[:, 0:2]), ones, minimum, ones.view(np.uint8)
            )
        else:
            decoded = Decoded(_codes(unit, kind, f), _f16(blocks[:, 0:2]), ones)
    return Decoded(
        decoded.codes.reshape(rows, k),
        decoded.d.reshape(rows, k // f.super),
        decoded.sc.reshape(rows, k // f.sub),
        None if decoded.dmin is None else decoded.dmin.reshape(rows, k // f.super),
        None if decoded.m is None else decoded.m.reshape(rows, k // f.sub),
    )


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16).reshape(-1)


def _codes(unit_blocks: np.ndarray, kind: GGMLQuantizationType, f: QuantFormat) -> np.ndarray:
    """The blocks' codes: gguf-py's values over unit scales, plus the offset it subtracted."""
    # As one row: gguf-py decodes a row group at a time, so one row of every block is fastest.
    values = dequantize(unit_blocks.reshape(1, -1), kind).reshape(-1) + f.offset
    if kind == GGMLQuantizationType.Q8_0:
        return values.astype(np.int8).view(np.uint8)
    return values.astype(np.uint8)
