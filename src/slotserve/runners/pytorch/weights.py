"""Weights into the decoder: an HF safetensors folder (sharded too), a GGUF file (dequantised
with the ``gguf`` package), or random values of the right shapes (``--load-format dummy``).

Every source yields ``(hf_name, tensor)`` pairs in HF's naming; :func:`load_into` copies each
into its place, the q/k/v and gate/up pieces into their rows of the fused projections, so no
second full copy of the model is ever held. Experts are named one by one
(``mlp.experts.{e}.gate_proj.weight``, as HF checkpoints store them); stacked expert tensors
(GGUF's ``ffn_*_exps``, a fused ``mlp.experts.gate_up_proj``) are cut into those names first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.runners.pytorch.config import ModelConfig
from slotserve.runners.pytorch.model import Decoder

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# Multimodal checkpoints (Gemma 3 4B+) keep the text model under a prefix.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def load_into(model: Decoder, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copies every named tensor into ``model``; raises if one is unknown or one is missing."""
    c = model.config
    expected = _expected_names(c)
    seen: set[str] = set()
    for raw_name, tensor in _per_expert(tensors):
        name = _normalise(raw_name)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = _target(model, name)
        if target.shape != tensor.shape:
            raise ValueError(f"{raw_name}: shape {tuple(tensor.shape)}, expected {target.shape}")
        target.copy_(tensor)
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _normalise(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return name


def _target(model: Decoder, name: str) -> torch.Tensor:
    c = model.config
    if name == "model.embed_tokens.weight":
        return model.embed.weight
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return model.lm_head.weight
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"unexpected tensor {name}")
    layer = model.decoder_layers[int(match.group(1))]
    part = match.group(2)
    expert = _EXPERT.match(part)
    if layer.sparse and expert is not None and int(expert.group(1)) < c.num_experts:
        mlp = layer.experts[int(expert.group(1))]
        inter = c.moe_intermediate_size
        return {
            "gate": mlp.gate_up.weight[:inter],
            "up": mlp.gate_up.weight[inter:],
            "down": mlp.down.weight,
        }[expert.group(2)]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    pieces: dict[str, torch.Tensor] = {
        "self_attn.q_proj.weight": layer.qkv.weight[:q],
        "self_attn.k_proj.weight": layer.qkv.weight[q : q + kv],
        "self_attn.v_proj.weight": layer.qkv.weight[q + kv :],
        "self_attn.o_proj.weight": layer.o_proj.weight,
        "input_layernorm.weight": layer.input_norm.weight,
        "post_attention_layernorm.weight": layer.post_attention_norm.weight,
    }
    if layer.sparse:
        pieces["mlp.gate.weight"] = layer.router.weight
    else:
        inter = c.intermediate_size
        pieces |= {
            "mlp.gate_proj.weight": layer.gate_up.weight[:inter],
            "mlp.up_proj.weight": layer.gate_up.weight[inter:],
            "mlp.down_proj.weight": layer.down.weight,
        }
    if c.attention_bias:
        pieces |= {
            "self_attn.q_proj.bias": layer.qkv.bias[:q],
            "self_attn.k_proj.bias": layer.qkv.bias[q : q + kv],
            "self_attn.v_proj.bias": layer.qkv.bias[q + kv :],
        }
    if c.qk_norm:
        pieces |= {
            "self_attn.q_norm.weight": layer.q_norm.weight,
            "self_attn.k_norm.weight": layer.k_norm.weight,
        }
    if c.gemma_norms:
        pieces |= {
            "pre_feedforward_layernorm.weight": layer.pre_mlp_norm.weight,
            "post_feedforward_layernorm.weight": layer.post_mlp_norm.weight,
        }
    if part not in pieces:
        raise ValueError(f"unexpected tensor {name}")
    return pieces[part]


def _expected_names(c: ModelConfig) -> set[str]:
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    if c.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if c.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if c.gemma_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not c.tie_word_embeddings:
        names.add("lm_head.weight")
    names |= {f"model.layers.{i}.{p}" for i in range(c.num_layers) for p in per_layer}
    dense_mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    sparse_mlp = ["mlp.gate.weight"] + [
        f"mlp.experts.{e}.{p}_proj.weight"
        for e in range(c.num_experts)
        for p in ("gate", "up", "down")
    ]
    for i in range(c.num_layers):
        names |= {f"model.layers.{i}.{p}" for p in (sparse_mlp if c.is_sparse(i) else dense_mlp)}
    return names


_STACKED = re.compile(
    r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$"
)


def _per_expert(
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cuts stacked expert tensors ([experts, rows, columns]) into one tensor per expert under
    HF's per-expert names; a fused ``gate_up_proj`` holds each expert's gate rows then its up
    rows."""
    for name, tensor in tensors:
        stacked = _STACKED.match(name)
        if stacked is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, kind = stacked.group(1), stacked.group(2)
        for expert, rows in enumerate(tensor):
            if kind == "gate_up_proj":
                gate, up = rows.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
            else:
                yield f"{prefix}.{expert}.{kind}.weight", rows


# ---- sources --------------------------------------------------------------------------------


def safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json``
    lists, one at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor an index of shards")
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, shard.get_tensor(name)


def dummy_tensors(c: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights of the configuration's shapes (benchmarks without the real weights)."""
    generator = torch.Generator().manual_seed(seed)
    norm_value = 0.0 if c.gemma_norms else 1.0  # Gemma stores (w - 1)
    shapes = _shapes(c)
    for name in sorted(_expected_names(c)):
        shape = shapes(name)
        if "norm" in name:
            yield name, torch.full(shape, norm_value)
        else:
            yield name, torch.randn(shape, generator=generator) * 0.02


def _shapes(c: ModelConfig) -> Any:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    by_part = {
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (c.hidden_size, q),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "mlp.gate.weight": (c.num_experts, c.hidden_size),
    }
    moe = c.moe_intermediate_size
    by_expert_part = {"gate": (moe, c.hidden_size), "up": (moe, c.hidden_size)}

    def shape(name: str) -> tuple[int, ...]:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.hidden_size)
        match = _LAYER.match(name)
        expert = _EXPERT.match(match.group(2)) if match else None
        if expert is not None:
            return by_expert_part.get(expert.group(2), (c.hidden_size, moe))
        if match is None or match.group(2) not in by_part:
            return (c.hidden_size,)  # the norms
        return by_part[match.group(2)]

    return shape


# GGUF tensor names (llama.cpp's) → HF names; ``{i}`` is the layer.
_GGUF_NAMES = {
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
    # Qwen3-MoE: the router, and every expert stacked in one tensor (cut by _per_expert).
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj.weight",
}
_GGUF_LLAMA_NORMS = {"blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}
_GGUF_GEMMA_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_tensors(reader: Any, c: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised tensors of a ``gguf.GGUFReader`` under HF names.

    llama.cpp's converter permutes the rows of Llama's q/k projections (its rotary embedding
    pairs adjacent values; HF's pairs the two halves): they are permuted back. It also stores
    Gemma's norm weights as ``1 + w``: 1 is taken off.
    """
    from gguf.quants import dequantize

    names = {**_GGUF_NAMES, **(_GGUF_GEMMA_NORMS if c.gemma_norms else _GGUF_LLAMA_NORMS)}
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
        if c.model_type in ("llama", "mistral") and template in (
            "blk.{i}.attn_q.weight",
            "blk.{i}.attn_k.weight",
        ):
            heads = c.num_heads if template.endswith("attn_q.weight") else c.num_kv_heads
            weights = _unpermute(weights, heads)
        if c.gemma_norms and "norm" in template:
            weights = weights - 1.0
        yield hf_name, weights


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of the converter's ``reshape(heads, 2, d, ...).swapaxes(1, 2)``."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
        .transpose(1, 2)
        .reshape(weights.shape)
    )
