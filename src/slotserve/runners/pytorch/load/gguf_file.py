"""A GGUF file: its metadata as plain values, and its tensors under HF names (dequantised with
the ``gguf`` package), what llama.cpp's converter changed undone by the model's family.
:func:`weights.load_into` takes them from there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.runners.pytorch.families.registry import family_of
from slotserve.runners.pytorch.model.config import ModelConfig


def open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_metadata(reader: object) -> dict[str, object]:
    """GGUF key/value metadata as plain Python values (and the tensor names)."""
    metadata: dict[str, object] = {}
    for key, field in reader.fields.items():  # type: ignore[attr-defined]
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            continue  # the vocabulary: large, and the tokenizer reads it itself
        try:
            metadata[key] = field.contents()
        except Exception:  # a field type this reader cannot turn into Python values
            continue
    metadata["_tensor_names"] = [t.name for t in reader.tensors]  # type: ignore[attr-defined]
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # type: ignore[attr-defined]
    if tokens is not None:
        metadata["_vocab_tokens"] = len(tokens.data)
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


def gguf_tensors(reader: Any, c: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised tensors of a ``gguf.GGUFReader`` under HF names, with what llama.cpp's
    converter changed undone by the model's family."""
    from gguf.quants import dequantize

    family = family_of(c)
    names = {**GGUF_NAMES, **family.gguf_names}
    for tensor in reader.tensors:
        template, layer = tensor.name, None
        match = _GGUF_BLOCK.match(tensor.name)
        if match:
            layer = match.group(1)
            template = "blk.{i}." + match.group(2)
        if template not in names:
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
        hf_name = names[template].format(i=layer)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = torch.from_numpy(values.reshape(shape).copy())
        yield hf_name, family.gguf_tensor(template, weights, c)
