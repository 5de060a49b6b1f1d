"""Qwen2.5-VL's text model (``qwen2_5_vl``; its ``text_config`` is ``qwen2_5_vl_text``): Qwen2's
decoder with M-RoPE, whose rotary dims turn by three positions (``mrope_section``). The vision
tower is the runner's ``vision/`` package's; the decoder skips its weights."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig, UnsupportedModelError


def _config(hf: HfConfig) -> ModelConfig:
    section = tuple(int(s) for s in hf.rope.get("mrope_section") or ())
    if 2 * sum(section) != hf.head_dim:
        raise UnsupportedModelError(
            f"{hf.name}: mrope_section {list(section)} must split half of head_dim {hf.head_dim}"
        )
    return hf.decoder(attention_bias=True, mrope_section=section)


FAMILY = Family(
    model_types=("qwen2_5_vl_text", "qwen2_5_vl"),
    config=_config,
    multimodal=("qwen2_5_vl",),
    text_prefixes=("model.language_model.",),
    skipped_weights=("model.visual.", "visual."),
)
