"""Qwen3 (``qwen3``): Llama's decoder with RMSNorm on each head's queries and keys."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import LLAMA_CPP_FFN_NORM, Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    return hf.decoder(qk_norm=True)


FAMILY = Family(
    model_types=("qwen3",),
    config=_config,
    gguf_architectures={"qwen3": "qwen3"},
    gguf_names=LLAMA_CPP_FFN_NORM,
)
