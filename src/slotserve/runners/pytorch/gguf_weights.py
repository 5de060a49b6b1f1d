"""A GGUF file's tensors under HF names (dequantised with the ``gguf`` package), undoing what
llama.cpp's converter changed: Llama's q/k row permutation, Gemma's and Qwen3.5's ``1 + w``
norms, Qwen3.5's DeltaNet layout. :func:`weights.load_into` takes them from there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from slotserve.runners.pytorch.config import ModelConfig

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
# Qwen3.5 (``qwen35``, ``qwen35moe``): Gated DeltaNet layers under llama.cpp's SSM names, the
# shared expert, and the attention's one post-attention norm.
_GGUF_QWEN35 = {
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
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

    norms = _GGUF_GEMMA_NORMS if c.gemma_norms else _GGUF_LLAMA_NORMS
    names = {**_GGUF_NAMES, **(_GGUF_QWEN35 if c.linear_layers else norms)}
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
        if c.plus_one_norms and "norm" in template and template != "blk.{i}.ssm_norm.weight":
            weights = weights - 1.0
        if c.linear_layers:
            weights = _from_qwen35_gguf(template, weights, c)
        yield hf_name, weights


def _from_qwen35_gguf(template: str, weights: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """Undoes the converter's DeltaNet changes: ``ssm_a`` holds ``-exp(A_log)``, the
    convolution lost its middle axis, the shared expert's gate may be flat, and with fewer key
    than value heads the value heads were reordered from grouped (key head k's r value heads
    together) to tiled (``v * n_k + k``) in every tensor that has them."""
    nk, nv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    part = template.removeprefix("blk.{i}.")
    if part == "ssm_a":
        weights = torch.log(-weights)
    elif part == "ssm_conv1d.weight":
        weights = weights.reshape(weights.shape[0], 1, -1)
    elif part == "ffn_gate_inp_shexp.weight":
        return weights.reshape(1, -1)
    if nk == nv:
        return weights
    key_channels = 2 * nk * c.linear_key_head_dim
    if part in ("attn_qkv.weight", "ssm_conv1d.weight"):
        values = _grouped(weights[key_channels:], nk, nv, dv)
        return torch.cat([weights[:key_channels], values])
    if part == "attn_gate.weight":
        return _grouped(weights, nk, nv, dv)
    if part in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return _grouped(weights, nk, nv, 1)
    if part == "ssm_out.weight":
        return _grouped(weights.T, nk, nv, dv).T.contiguous()
    return weights


def _grouped(rows: torch.Tensor, nk: int, nv: int, block: int) -> torch.Tensor:
    """Value-head blocks of ``block`` rows from tiled order back to grouped order."""
    rest = rows.shape[1:]
    tiled = rows.reshape(nv // nk, nk, block, *rest)
    return tiled.transpose(0, 1).reshape(rows.shape).contiguous()


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of the converter's ``reshape(heads, 2, d, ...).swapaxes(1, 2)``."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
        .transpose(1, 2)
        .reshape(weights.shape)
    )
