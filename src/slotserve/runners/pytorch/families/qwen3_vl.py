"""Qwen3-VL's text model (``qwen3_vl``; its ``text_config`` is ``qwen3_vl_text``): Qwen3's
decoder with interleaved M-RoPE, and the vision tower's "deepstack" features added to the
image positions after its first layers (the tower gives them: ``families/vision/qwen_vl.py``). The
tower's weights are not the decoder's."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.families.vision.qwen_vl import QwenVlVision
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    # transformers reads no switch: Qwen3-VL's M-RoPE is always interleaved.
    return hf.decoder(qk_norm=True, mrope_interleaved=True, **hf.mrope())


FAMILY = Family(
    model_types=("qwen3_vl_text", "qwen3_vl"),
    config=_config,
    multimodal=("qwen3_vl",),
    text_prefixes=("model.language_model.",),
    skipped_weights=("model.visual.", "visual."),
    vision=QwenVlVision("qwen3_vl", "Qwen3VLConfig", "Qwen3VLVisionModel"),
)
