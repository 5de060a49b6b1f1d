"""Gemma 3 text (``gemma3_text``; ``gemma3``, whose multimodal checkpoints hold it under
``text_config``): embeddings scaled by sqrt(hidden), RMSNorm weights stored as (w - 1), four
norms per layer, GeGLU (tanh GELU), query scaling from ``query_pre_attn_scalar``,
sliding-window layers with their own rotary base. GGUF: ``gemma3``, its norms stored as
``1 + w``. Its images: SigLIP and a projector (``families/vision/gemma3.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from slotserve.runners.pytorch.families.base import Family, GgufKeys, HfConfig
from slotserve.runners.pytorch.families.vision.gemma3 import Gemma3Vision
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    raw = hf.raw
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    else:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        sliding = tuple((i + 1) % pattern != 0 for i in range(hf.layers))
    local_theta = raw.get("rope_local_base_freq") or hf.local_rope.get("rope_theta") or 10000.0
    return hf.decoder(
        tie_word_embeddings=hf.flag("tie_word_embeddings", True),
        qk_norm=True,
        plus_one_norms=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_activation=hf.activation("gelu"),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding,
        rope_local_theta=float(local_theta),
    )


def _gguf_config(keys: GgufKeys, raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": int(keys("attention.sliding_window")),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": int(raw["head_dim"]),  # attention.key_length, as HF's
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _from_gguf(template: str, weights: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """llama.cpp stores the norm weights as ``1 + w``: 1 is taken off."""
    return weights - 1.0 if "norm" in template else weights


FAMILY = Family(
    model_types=("gemma3_text", "gemma3"),
    config=_config,
    multimodal=("gemma3",),
    text_prefixes=("model.language_model.", "language_model.model.", "language_model."),
    skipped_weights=(
        "model.vision_tower.",
        "vision_tower.",
        "model.multi_modal_projector.",
        "multi_modal_projector.",
    ),
    gguf_architectures={"gemma3": "gemma3_text"},
    gguf_config=_gguf_config,
    gguf_names={
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    gguf_tensor=_from_gguf,
    vision=Gemma3Vision(),
)
