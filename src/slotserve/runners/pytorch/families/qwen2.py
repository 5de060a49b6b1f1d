"""Qwen2 (``qwen2``): Llama's decoder with biases on the q/k/v projections (its
``sliding_window`` key is not read: every layer attends to the whole context)."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import LLAMA_CPP_FFN_NORM, Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    return hf.decoder(attention_bias=hf.flag("attention_bias", True))


FAMILY = Family(
    model_types=("qwen2",),
    config=_config,
    gguf_architectures={"qwen2": "qwen2"},
    gguf_names=LLAMA_CPP_FFN_NORM,
)
