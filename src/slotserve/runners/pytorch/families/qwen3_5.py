"""Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``, and their ``_text`` models). Per ``layer_types``,
Gated DeltaNet linear-attention layers (``model/deltanet.py``) and full-attention layers whose
output is gated (``q_proj`` gives each head's query and gate) and whose rotary embedding turns
the first ``partial_rotary_factor`` of each head; RMSNorm weights stored as (w - 1). The MoE
variant renormalises its top-k and adds a shared expert gated by a sigmoid.

GGUF (``qwen35``, ``qwen35moe``): llama.cpp keeps the DeltaNet sizes under its SSM keys and
tensor names, and changes some tensors' layout (undone by :func:`_from_gguf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from slotserve.runners.pytorch.families.base import Family, GgufKeys, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig, UnsupportedModelError

_MOE = ("qwen3_5_moe", "qwen3_5_moe_text")


def _config(hf: HfConfig) -> ModelConfig:
    raw = hf.raw
    types = raw.get("layer_types") or [
        "full_attention"
        if (i + 1) % int(raw.get("full_attention_interval") or 4) == 0
        else "linear_attention"
        for i in range(hf.layers)
    ]
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"{hf.name}: layer types {sorted(unknown)} are not supported")
    partial = hf.rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 0.25
    return hf.decoder(
        qk_norm=True,
        plus_one_norms=True,
        linear_layers=tuple(t == "linear_attention" for t in types),
        # The MoE variant: every layer sparse, the top-k always renormalised.
        sparse_layers=(hf.experts > 0,) * hf.layers if hf.model_type in _MOE else (),
        norm_topk_prob=hf.flag("norm_topk_prob", True),
        attn_output_gate=True,  # always on (transformers has no switch)
        # As transformers: int(head_dim × factor); a GGUF states the dim itself.
        rotary_dim=int(raw.get("rotary_dim") or hf.head_dim * float(partial)),
    )


def _gguf_config(keys: GgufKeys, raw: Mapping[str, Any]) -> dict[str, Any]:
    value_heads = int(keys("ssm.time_step_rank"))
    extra = {
        "linear_num_key_heads": int(keys("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(keys("ssm.state_size")),
        "linear_value_head_dim": int(keys("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(keys("ssm.conv_kernel")),
        "full_attention_interval": int(keys("full_attention_interval", 4)),
        "rotary_dim": int(keys("rope.dimension_count", int(raw["head_dim"]) // 4)),
    }
    if keys.arch == "qwen35moe":
        extra |= {
            "num_experts": int(keys.optional("expert_count") or 0),
            "num_experts_per_tok": int(keys("expert_used_count")),
            "moe_intermediate_size": int(keys("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(keys("expert_shared_feed_forward_length", 0)),
        }
    return extra


# Gated DeltaNet layers under llama.cpp's SSM names, the shared expert, and the attention's one
# post-attention norm.
_GGUF_NAMES = {
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


def _from_gguf(template: str, weights: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """Undoes the converter's changes: the norms stored as ``1 + w`` (the DeltaNet norm is a
    plain one), ``ssm_a`` holding ``-exp(A_log)``, the convolution's lost middle axis, a flat
    shared-expert gate, and with fewer key than value heads the value heads reordered from
    grouped (key head k's r value heads together) to tiled (``v * n_k + k``) in every tensor
    that has them."""
    if "norm" in template and template != "blk.{i}.ssm_norm.weight":
        weights = weights - 1.0
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


FAMILY = Family(
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
    config=_config,
    multimodal=("qwen3_5", "qwen3_5_moe"),
    text_prefixes=("model.language_model.", "language_model.model.", "language_model."),
    # The vision tower, and the multi-token-prediction head (one token per step here).
    skipped_weights=("model.visual.", "mtp."),
    gguf_architectures={"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"},
    gguf_config=_gguf_config,
    gguf_names=_GGUF_NAMES,
    gguf_tensor=_from_gguf,
)
