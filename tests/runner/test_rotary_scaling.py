"""Rotary frequency scaling against transformers' own: YaRN's frequencies and its attention
factor on cos and sin, from a config's ``rope_scaling`` or one laid over it (``--hf-overrides``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from slotserve.runners.pytorch.families.registry import config_from_hf, with_overrides
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.model.rotary import rotary_tables

YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8},
]


def _llama(**settings: Any) -> dict[str, Any]:
    """A small Llama's config.json with ``settings`` over it."""
    return {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        **settings,
    }


@pytest.mark.parametrize("scaling", YARN, ids=["original-context", "betas", "attention-factor"])
def test_yarn_tables_are_transformers_own(scaling: dict[str, Any]) -> None:
    raw = _llama(rope_theta=50000.0, rope_scaling=scaling)
    config = config_from_hf(raw, "yarn")
    assert config.rope_scaling.kind == "yarn"
    cos, sin = rotary_tables(config, config.rope_theta, 8192, torch.float32)
    reference = LlamaRotaryEmbedding(LlamaConfig(**raw))
    positions = torch.arange(8192)[None]
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, ref_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0], rtol=1e-5, atol=1e-5)


def test_an_unknown_scaling_is_refused_by_name() -> None:
    raw = _llama(rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        config_from_hf(raw, "longrope")


def test_rope_scaling_laid_over_joins_transformers_5_rope_parameters() -> None:
    # Read first, rope_parameters would hide a rope_scaling laid beside it; its theta stays.
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    raw = _llama(rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    config = config_from_hf(raw, "m", yarn)
    assert config.rope_scaling.kind == "yarn" and config.rope_theta == 50000.0
    per_layer = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    merged = with_overrides({"rope_parameters": per_layer}, yarn)
    assert merged["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    assert merged["rope_parameters"]["sliding_attention"] == {"rope_theta": 1e4}
