"""A weight kept as its quantized blocks on the way from a checkpoint to a projection: the GGUF
file's own blocks (a type of ``formats.FORMATS``), or a dense tensor quantized at load
(``--quantization``, llama.cpp's round-to-nearest through gguf-py's quantizer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from slotserve.runners.pytorch.quant.formats import FORMATS, QuantKind


@dataclass(frozen=True)
class QuantTensor:
    """``raw``: [rows, k / block · type size] uint8, one row of blocks per output; ``order``:
    which of them each output is (None: in order), so a permutation of a file's rows is read
    from its mapping when packed, never copied."""

    kind: QuantKind
    raw: np.ndarray
    k: int
    order: np.ndarray | None = None

    @property
    def shape(self) -> torch.Size:
        rows = self.raw.shape[0] if self.order is None else len(self.order)
        return torch.Size((rows, self.k))

    def take_rows(self, order: np.ndarray) -> QuantTensor:
        """The rows in ``order`` (a row permutation leaves every block whole)."""
        taken = order if self.order is None else self.order[order]
        return QuantTensor(self.kind, self.raw, self.k, np.asarray(taken, dtype=np.int64))


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
