"""Decoded rows (formats.py) packed into the records csrc/quant_gemm.h streams: outputs in
groups of 16, one record per group and super-block (the layout is stated there), written one
chunk of rows per thread at a time, so a large tensor never exists unpacked in full."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf import GGMLQuantizationType

from slotserve.runners.pytorch.quant.formats import FORMATS, Decoded, QuantFormat, decode_rows

GROUP = 16  # outputs a record holds
CHUNK_ROWS = GROUP * 16  # rows decoded at once: their float intermediates stay small


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
    if f.bits == 4:
        parts.append(_nibble_units(decoded.codes, g, b, f.super))
    else:
        parts.extend(_pair_codes(decoded.codes, g, b, pairs, f.bits))
    records = np.concatenate([p.astype(np.uint8, copy=False) for p in parts], axis=2)
    assert records.shape[2] == f.record_bytes
    return records


def _nibble_units(codes: np.ndarray, g: int, b: int, super_: int) -> np.ndarray:
    """Four-bit codes per unit of 8 inputs, 16 outputs: byte 4j + i holds output j's code of
    input i in its low nibble and of input 4 + i in its high one (vpdpbusd's order)."""
    units = codes.reshape(g, GROUP, b, super_ // 8, 2, 4).transpose(0, 2, 3, 4, 1, 5)
    both: np.ndarray = units[:, :, :, 0] | (units[:, :, :, 1] << 4)
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


def pack_tensor(kind: GGMLQuantizationType, raw: np.ndarray, k: int) -> torch.Tensor:
    """A GGUF tensor of ``kind`` ([n, k / block · type size] uint8 rows) as the kernels' records
    (a flat uint8 tensor); the last group's missing outputs are zeros. Chunks of rows are packed
    on torch's intra-op thread count at once (numpy lets go of the GIL while it works)."""
    f = FORMATS[kind]
    n = raw.shape[0]
    out = np.empty((-(-n // GROUP), k // f.super, f.record_bytes), dtype=np.uint8)

    def pack_chunk(start: int) -> None:
        rows = raw[start : start + CHUNK_ROWS]
        decoded = decode_rows(kind, rows, k)
        missing = -len(rows) % GROUP
        if missing:
            decoded = Decoded(
                _padded(decoded.codes, missing),
                _padded(decoded.d, missing),
                _padded(decoded.sc, missing),
                None if decoded.dmin is None else _padded(decoded.dmin, missing),
                None if decoded.m is None else _padded(decoded.m, missing),
            )
        first = start // GROUP
        out[first : first + (len(rows) + missing) // GROUP] = pack_rows(decoded, f)

    starts = range(0, n, CHUNK_ROWS)
    workers = max(1, min(torch.get_num_threads(), len(starts)))
    with ThreadPoolExecutor(workers, thread_name_prefix="slotserve-pack") as pool:
        list(pool.map(pack_chunk, starts))  # list(): a chunk's error is raised here
    return torch.from_numpy(out.reshape(-1))


def _padded(values: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([values, np.zeros((rows, values.shape[1]), dtype=values.dtype)])
