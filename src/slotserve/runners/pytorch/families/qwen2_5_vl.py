"""Qwen2.5-VL's text model (``qwen2_5_vl``; its ``text_config`` is ``qwen2_5_vl_text``): Qwen2's
decoder with M-RoPE, whose rotary dims turn by three positions (``mrope_section``). Its images:
the Qwen-VL preparer and tower (``families/vision/qwen_vl.py``); the decoder skips the tower's
weights."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.families.vision.qwen_vl import QwenVlVision
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    return hf.decoder(attention_bias=True, **hf.mrope())


FAMILY = Family(
    model_types=("qwen2_5_vl_text", "qwen2_5_vl"),
    config=_config,
    multimodal=("qwen2_5_vl",),
    text_prefixes=("model.language_model.",),
    skipped_weights=("model.visual.", "visual."),
    vision=QwenVlVision(
        "qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VisionTransformerPretrainedModel"
    ),
)
