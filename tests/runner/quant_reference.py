"""The reference packing of a GGUF tensor, in numpy: codes and scales read through gguf-py's own
decoder (over blocks whose scales are set to one and minimums to zero, so the bit layouts are
gguf-py's, not a copy of them), then written in csrc/quant_gemm.h's record layout. The kernels'
``quant_pack`` must give its bytes; the stated arithmetic of test_quant_kernels.py reads its
decoded values."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from slotserve.runners.pytorch.quant.formats import (
    FORMATS,
    GROUP,
    OwnType,
    QuantFormat,
    QuantKind,
    block_size,
)

_ONE = np.array([1.0], dtype=np.float16).view(np.uint8)
_ZERO = np.array([0.0], dtype=np.float16).view(np.uint8)
# Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums: every scale 1, every minimum 0.
_K_UNIT_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)


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


def decode_rows(kind: QuantKind, raw: np.ndarray, k: int) -> Decoded:
    """``raw``: rows of GGUF blocks ([rows, k / block · type size] uint8, as gguf-py's reader
    gives a quantized tensor)."""
    block, size = block_size(kind)
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows * (k // block), size)
    unit = blocks.copy()
    f = FORMATS[kind]
    if kind == OwnType.Q4_ZP:  # d | a zero per 32 | each 32's nibbles as Q4_0's
        nibbles = blocks[:, 6:].reshape(-1, 4, 16)
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(-1, 128)
        ones = np.ones((blocks.shape[0], 4), dtype=np.int8)
        d = _f16(blocks[:, 0:2])
        decoded = Decoded(codes, d, ones, d.copy(), blocks[:, 2:6].copy())
    elif kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
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


def dequantized(raw: np.ndarray, kind: QuantKind, n: int, k: int) -> np.ndarray:
    """The weights in float32: gguf-py's dequantizer, or for Q4_ZP ``d · (q − z)``."""
    if isinstance(kind, GGMLQuantizationType):
        return dequantize(raw, kind).reshape(n, k)
    decoded = decode_rows(kind, raw, k)
    assert decoded.m is not None
    zeros = np.repeat(decoded.m.astype(np.float32), 32, axis=1)
    scales = np.repeat(decoded.d.astype(np.float32), 128, axis=1)
    return (scales * (decoded.codes.astype(np.float32) - zeros)).astype(np.float32)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16).reshape(-1)


def _codes(unit_blocks: np.ndarray, kind: GGMLQuantizationType, f: QuantFormat) -> np.ndarray:
    """The blocks' codes: gguf-py's values over unit scales, plus the offset it subtracted."""
    # As one row: gguf-py decodes a row group at a time, so one row of every block is fastest.
    values = dequantize(unit_blocks.reshape(1, -1), kind).reshape(-1) + f.offset
    if kind == GGMLQuantizationType.Q8_0:
        return values.astype(np.int8).view(np.uint8)
    return values.astype(np.uint8)


def pack_rows(decoded: Decoded, f: QuantFormat) -> np.ndarray:
    """Whole groups of rows (``rows`` a multiple of 16) as records, [groups, supers, bytes]."""
    rows, k = decoded.codes.shape
    g, b, pairs, subs = rows // GROUP, k // f.super, f.super // 2, f.super // f.sub

    def per_output(values: np.ndarray, per_super: int) -> np.ndarray:
        # [rows, supers · per_super] → [groups, supers, per_super · 16 outputs] bytes
        grouped = values.reshape(g, GROUP, b, per_super).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(grouped).view(np.uint8).reshape(g, b, -1)

    parts = [per_output(decoded.d, 1)]
    if f.has_min:
        assert decoded.dmin is not None
        parts.append(per_output(decoded.dmin, 1))
    if f.sub_scales:
        parts.append(per_output(decoded.sc, subs))
        if f.has_min:
            assert decoded.m is not None
            parts.append(per_output(decoded.m, subs))
    if f.bits in (4, 6):
        parts.append(_nibble_units(decoded.codes & 0x0F, g, b, f.super))
        if f.bits == 6:
            parts.append(_high_plane(decoded.codes >> 4, g, b, f.super))
    else:
        parts.extend(_pair_codes(decoded.codes, g, b, pairs, f.bits))
    records = np.concatenate([p.astype(np.uint8, copy=False) for p in parts], axis=2)
    assert records.shape[2] == f.record_bytes
    return records


def _nibble_units(codes: np.ndarray, g: int, b: int, super_: int) -> np.ndarray:
    """Four-bit codes (or six-bit codes' low four) per unit of 8 inputs, 16 outputs: byte 4j + i
    holds output j's code of input i in its low nibble and of input 4 + i in its high one
    (vpdpbusd's order)."""
    units = codes.reshape(g, GROUP, b, super_ // 8, 2, 4).transpose(0, 2, 3, 4, 1, 5)
    both: np.ndarray = units[:, :, :, 0] | (units[:, :, :, 1] << 4)
    return both.reshape(g, b, -1)


def _high_plane(high: np.ndarray, g: int, b: int, super_: int) -> np.ndarray:
    """Six-bit codes' high two bits, per two units of 8 inputs 64 bytes: byte 4j + i holds
    output j's of the even unit's input i at bits 4-5 and input 4 + i at 6-7, the odd unit's at
    0-1 and 2-3."""
    units = high.reshape(g, GROUP, b, super_ // 16, 2, 2, 4).transpose(0, 2, 3, 4, 5, 1, 6)
    # [groups, supers, unit pairs, (even, odd), (inputs 0-3, 4-7), 16 outputs, 4 inputs]
    per_unit = units[:, :, :, :, 0] | (units[:, :, :, :, 1] << 2)
    both: np.ndarray = (per_unit[:, :, :, 0] << 4) | per_unit[:, :, :, 1]
    return both.reshape(g, b, -1)


def _pair_codes(codes: np.ndarray, g: int, b: int, pairs: int, bits: int) -> list[np.ndarray]:
    """Five- and eight-bit codes per input pair, in vpmaddwd's word order: "lo", outputs 0-7's
    (even, odd) codes, then "hi", outputs 8-15's."""
    # [groups, supers, pairs, 16 outputs, (even, odd)]
    paired = codes.reshape(g, GROUP, b, pairs, 2).transpose(0, 2, 3, 1, 4)
    lo = paired[:, :, :, : GROUP // 2].reshape(g, b, pairs, GROUP)
    hi = paired[:, :, :, GROUP // 2 :].reshape(g, b, pairs, GROUP)
    if bits == 8:
        return [np.concatenate([lo, hi], axis=3).reshape(g, b, -1)]
    # Five bits: the low four as nibbles, then per 4 pairs bit 2j lo's fifth bit, 2j + 1 hi's.
    high_lo = ((lo >> 4) & 1).reshape(g, b, pairs // 4, 4, GROUP)
    high_hi = ((hi >> 4) & 1).reshape(g, b, pairs // 4, 4, GROUP)
    high = sum(
        (high_lo[:, :, :, j] << (2 * j)) | (high_hi[:, :, :, j] << (2 * j + 1)) for j in range(4)
    )
    return [
        ((lo & 0x0F) | ((hi & 0x0F) << 4)).reshape(g, b, -1),
        np.asarray(high, dtype=np.uint8).reshape(g, b, -1),
    ]


def reference_pack(kind: QuantKind, raw: np.ndarray, k: int) -> np.ndarray:
    """A GGUF tensor of ``kind`` ([n, k / block · type size] uint8 rows) as flat records; the
    last group's missing outputs are zeros."""
    decoded = decode_rows(kind, raw, k)
    missing = -raw.shape[0] % GROUP
    if missing:
        decoded = Decoded(
            _padded(decoded.codes, missing),
            _padded(decoded.d, missing),
            _padded(decoded.sc, missing),
            None if decoded.dmin is None else _padded(decoded.dmin, missing),
            None if decoded.m is None else _padded(decoded.m, missing),
        )
    return pack_rows(decoded, FORMATS[kind]).reshape(-1)


def _padded(values: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([values, np.zeros((rows, values.shape[1]), dtype=values.dtype)])
