"""Qwen2.5-VL's text model (``qwen2_5_vl``; its ``text_config`` is ``qwen2_5_vl_text``): Qwen2's
decoder with M-RoPE, whose rotary dims turn by three positions (``mrope_section``). The vision
tower is the runner's ``vision/`` package's; the decoder skips its weights."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    return hf.decoder(attention_bias=True, **hf.mrope())


FAMILY = Family(
    model_types=("qwen2_5_vl_text", "qwen2_5_vl"),
    config=_config,
    multimodal=("qwen2_5_vl",),
    text_prefixes=("model.language_model.",),
    skipped_weights=("model.visual.", "visual."),
)
