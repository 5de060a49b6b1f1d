"""A GGUF file, as the load plan reads a checkpoint (``checkpoint.py``): its metadata as plain
values, read by its family as the ``config.json`` it was converted from; its tensors under HF
names (dequantised with the ``gguf`` package: the weight format's seam, ``weight_format.py``),
what llama.cpp's converter changed undone by the family; its ``general.sampling.*`` keys; the
tokenizer transformers converts from it. :func:`weights.load_into` takes the tensors from
there."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.engine.sampling_defaults import LLAMA_SERVER, SamplingDefaults, from_gguf
from slotserve.runners.pytorch.families.registry import config_from_gguf, family_of
from slotserve.runners.pytorch.families.vision.base import Vision
from slotserve.runners.pytorch.load.gguf_header import GgufHeader
from slotserve.runners.pytorch.load.tokenizer import HfTokenizer
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.quant.formats import FORMATS
from slotserve.runners.pytorch.quant.tensor import QuantTensor


@dataclass(frozen=True)
class GgufFile:
    """Nothing is read until it is asked for; the header is parsed once."""

    path: Path
    overrides: str | None = None  # --hf-overrides: JSON laid over the settings, by HF names

    @property
    def name(self) -> str:
        return self.path.stem

    # A GGUF file holds no ``config.json`` of its own: no classifier head, no vision tower.
    @property
    def raw_config(self) -> Mapping[str, Any]:
        return {}

    @property
    def vision(self) -> Vision | None:
        return None

    @cached_property
    def header(self) -> GgufHeader:
        """The metadata and the tensor table, parsed at the first use."""
        return GgufHeader(self.path)

    @cached_property
    def config(self) -> ModelConfig:
        overrides = json.loads(self.overrides) if self.overrides else None
        return config_from_gguf(gguf_metadata(self.header), self.name, overrides)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return gguf_tensors(self.header, self.config)

    def quantized_tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """As :meth:`tensors`, but matrices of a type the quantized kernels multiply stay
        their blocks (``quant/tensor.py``) wherever the family's undoing of the converter
        only reorders rows."""
        return gguf_tensors(self.header, self.config, keep_quantized=True)

    def quantized_types(self) -> set[str]:
        """The quantization types of the file's matrices (``Q4_K``, ``F16``, ...)."""
        return {t.tensor_type.name for t in self.header.tensors if len(t.shape) >= 2}

    def tokenizer(self) -> HfTokenizer:
        return HfTokenizer.from_gguf(self.path)

    def sampling_defaults(self) -> SamplingDefaults:
        """The ``general.sampling.*`` keys over llama-server's defaults: what users of a GGUF
        file expect, whichever runner serves it."""
        own = from_gguf(self.header.fields.get)
        return own.over(LLAMA_SERVER)

    def pooling(self) -> str | None:
        return None


def gguf_metadata(header: GgufHeader) -> dict[str, object]:
    """GGUF key/value metadata as plain Python values (and the tensor names)."""
    metadata: dict[str, object] = {
        key: header.fields[key]
        for key in header.fields
        # The vocabulary: large, and the tokenizer reads it itself.
        if not key.startswith("tokenizer.ggml.")
        or key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    }
    metadata["_tensor_names"] = [t.name for t in header.tensors]
    tokens = header.array_length("tokenizer.ggml.tokens")
    if tokens is not None:
        metadata["_vocab_tokens"] = tokens
    return metadata


# llama.cpp's names for the shared decoder's tensors → HF names (``{i}``: the layer); a family
# adds its own (``Family.gguf_names``).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # Mixtures of experts: the router, and every expert stacked in one tensor (cut into
    # one tensor per expert by ``weights.load_into``).
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj.weight",
}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def row_order(
    transform: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size
) -> np.ndarray | None:
    """The rows ``transform`` puts where, if all it does to a matrix of ``shape`` is reorder
    its rows (else None): found by transforming each value's own row and column index, over a
    few columns only (a family's undoing acts on rows whatever the width, or fails, or moves
    columns, and is then refused), so an embedding of 10⁸ values costs no gigabytes here."""
    rows, columns = shape[0], min(shape[1], 64)
    shape = torch.Size((rows, columns))
    row_index = torch.arange(rows, dtype=torch.float32)[:, None].expand(shape).contiguous()
    column_index = torch.arange(columns, dtype=torch.float32)[None, :].expand(shape).contiguous()
    try:
        moved_rows, moved_columns = transform(row_index), transform(column_index)
    except RuntimeError:
        return None
    order = moved_rows[:, 0]
    if not (
        moved_rows.shape == shape
        and torch.equal(moved_columns, column_index)
        and torch.equal(moved_rows, order[:, None].expand(shape))
        and torch.equal(order.sort().values, row_index[:, 0])
    ):
        return None
    return order.long().numpy()


def _undoing(family: Any, template: str, c: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda weights: family.gguf_tensor(template, weights, c)


def gguf_tensors(
    header: GgufHeader, c: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, Any]]:
    """Dequantised tensors of a GGUF file under HF names, with what llama.cpp's
    converter changed undone by the model's family; ``keep_quantized``: matrices of the
    quantized kernels' types stay blocks where that undoing only reorders their rows."""
    from gguf.quants import dequantize

    family = family_of(c)
    names = {**GGUF_NAMES, **family.gguf_names}
    orders: dict[tuple[str, torch.Size], np.ndarray | None] = {}
    for tensor in header.tensors:
        template, layer = tensor.name, None
        match = _GGUF_BLOCK.match(tensor.name)
        if match:
            layer = match.group(1)
            template = "blk.{i}." + match.group(2)
        if template not in names:
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
        hf_name = names[template].format(i=layer)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if keep_quantized and tensor.tensor_type in FORMATS and len(shape) == 2:
            blocks = QuantTensor(tensor.tensor_type, np.asarray(tensor.data), shape[1])
            key = (template, blocks.shape)
            if key not in orders:
                orders[key] = row_order(_undoing(family, template, c), blocks.shape)
            order = orders[key]
            if order is not None:  # a file's rows in order are read from its mapping, once
                in_order = bool((order == np.arange(len(order))).all())
                yield hf_name, blocks if in_order else blocks.take_rows(order)
                continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = torch.from_numpy(values.reshape(shape).copy())
        yield hf_name, family.gguf_tensor(template, weights, c)
