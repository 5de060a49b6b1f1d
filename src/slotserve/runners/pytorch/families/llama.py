"""Llama 2/3 and SmolLM2 (``llama``): the plain decoder (RMSNorm, SwiGLU, rotary embeddings
with Llama 3's or linear scaling, grouped-query attention), every field at its default. GGUF:
``llama``, the architecture llama.cpp also converts Mistral as."""

from __future__ import annotations

import torch

from slotserve.runners.pytorch.families.base import LLAMA_CPP_FFN_NORM, Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    return hf.decoder()


def _from_gguf(template: str, weights: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter permutes the rows of the q/k projections (its rotary embedding
    pairs adjacent values; HF's pairs the two halves): they are permuted back."""
    if template == "blk.{i}.attn_q.weight":
        return _unpermute(weights, c.num_heads)
    if template == "blk.{i}.attn_k.weight":
        return _unpermute(weights, c.num_kv_heads)
    return weights


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of the converter's ``reshape(heads, 2, d, ...).swapaxes(1, 2)``."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
        .transpose(1, 2)
        .reshape(weights.shape)
    )


FAMILY = Family(
    model_types=("llama",),
    config=_config,
    gguf_architectures={"llama": "llama"},
    gguf_names=LLAMA_CPP_FFN_NORM,
    gguf_tensor=_from_gguf,
)
