"""Qwen3-MoE (``qwen3_moe``): Qwen3's attention; the MLP of sparse layers is a softmax router
over ``num_experts`` SwiGLU experts of which ``num_experts_per_tok`` run per token (weights
renormalised when ``norm_topk_prob``); ``mlp_only_layers`` and ``decoder_sparse_step`` name the
dense ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slotserve.runners.pytorch.families.base import (
    LLAMA_CPP_FFN_NORM,
    Family,
    GgufKeys,
    HfConfig,
)
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    # transformers' rule: a layer is sparse unless listed dense or off the sparse step.
    dense = set(hf.raw.get("mlp_only_layers") or ())
    step = int(hf.raw.get("decoder_sparse_step") or 1)
    sparse = tuple(
        i not in dense and hf.experts > 0 and (i + 1) % step == 0 for i in range(hf.layers)
    )
    return hf.decoder(qk_norm=True, sparse_layers=sparse)


def _gguf_config(keys: GgufKeys, raw: Mapping[str, Any]) -> dict[str, Any]:
    # llama.cpp's graph renormalises the top-k weights and makes every layer sparse.
    used = int(keys("expert_used_count"))
    return {
        "num_experts": int(keys.optional("expert_count") or 0),
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(
            keys("expert_feed_forward_length", int(raw["intermediate_size"]) // used)
        ),
        "norm_topk_prob": True,
    }


FAMILY = Family(
    model_types=("qwen3_moe",),
    config=_config,
    gguf_architectures={"qwen3moe": "qwen3_moe"},
    gguf_config=_gguf_config,
    gguf_names=LLAMA_CPP_FFN_NORM,
)
