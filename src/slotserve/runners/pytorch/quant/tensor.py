"""A weight kept as its quantized blocks on the way from a checkpoint to a projection: the GGUF
file's own blocks (a type of ``formats.FORMATS``), or a dense tensor quantized at load
(``--quantization``, llama.cpp's round-to-nearest through gguf-py's quantizer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from slotserve.runners.pytorch.quant.formats import FORMATS


@dataclass(frozen=True)
class QuantTensor:
    """``raw``: [rows, k / block · type size] uint8, one row of blocks per output."""

    kind: GGMLQuantizationType
    raw: np.ndarray
    k: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.k))

    def take_rows(self, order: np.ndarray) -> QuantTensor:
        """The rows in ``order`` (a row permutation leaves every block whole)."""
        return QuantTensor(self.kind, np.ascontiguousarray(self.raw[order]), self.k)


# --quantization's choices: the types gguf-py can quantize to (llama.cpp's round-to-nearest).
QUANTIZE_TO = {
    "Q8_0": GGMLQuantizationType.Q8_0,
    "Q4_0": GGMLQuantizationType.Q4_0,
    "Q4_1": GGMLQuantizationType.Q4_1,
    "Q5_0": GGMLQuantizationType.Q5_0,
    "Q5_1": GGMLQuantizationType.Q5_1,
}


def quantized(tensor: torch.Tensor, kind: GGMLQuantizationType) -> QuantTensor:
    """A dense [rows, k] tensor rounded into ``kind``'s blocks, a slice of rows at a time."""
    rows, k = tensor.shape
    block, size = GGML_QUANT_SIZES[kind]
    if kind not in FORMATS or k % block:
        raise ValueError(f"{kind.name} needs inputs in whole blocks of {block}, not {k}")
    raw = np.empty((rows, k // block * size), dtype=np.uint8)
    for start in range(0, rows, 1024):
        part = tensor[start : start + 1024].float().numpy()
        raw[start : start + len(part)] = quantize(part, kind)
    return QuantTensor(kind, raw, k)
