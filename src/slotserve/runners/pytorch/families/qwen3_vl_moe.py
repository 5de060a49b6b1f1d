"""Qwen3-VL MoE (``qwen3_vl_moe``; its ``text_config`` is ``qwen3_vl_moe_text``): Qwen3-MoE's
decoder (``qwen3_moe.py``: which layers are sparse) with Qwen3-VL's interleaved M-RoPE and
deepstack features (``qwen3_vl.py``). Its experts are stacked, ``gate_up_proj`` and
``down_proj`` per layer (the loader cuts them, in either orientation)."""

from __future__ import annotations

from slotserve.runners.pytorch.families import qwen3_moe
from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.families.vision.qwen_vl import QwenVlVision
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    sparse = qwen3_moe.FAMILY.config(hf).sparse_layers
    # transformers' router always renormalises the chosen experts' weights (no switch read).
    return hf.decoder(
        qk_norm=True,
        sparse_layers=sparse,
        norm_topk_prob=True,
        mrope_interleaved=True,
        **hf.mrope(),
    )


FAMILY = Family(
    model_types=("qwen3_vl_moe_text", "qwen3_vl_moe"),
    config=_config,
    multimodal=("qwen3_vl_moe",),
    text_prefixes=("model.language_model.",),
    skipped_weights=("model.visual.", "visual."),
    vision=QwenVlVision("qwen3_vl_moe", "Qwen3VLMoeConfig", "Qwen3VLMoeVisionModel"),
)
