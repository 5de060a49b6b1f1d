"""The PyTorch runner's family table: every key names one family, and each family's
weight-name quirks stay its own."""

from __future__ import annotations

from collections import Counter

import pytest

from slotserve.runners.pytorch.families import gemma3, llama, qwen3_5
from slotserve.runners.pytorch.families.base import Family
from slotserve.runners.pytorch.families.registry import (
    DECODERS,
    ENCODERS,
    FAMILIES,
    GGUF_ARCHITECTURES,
    config_from_gguf,
)
from slotserve.runners.pytorch.model.config import UnsupportedModelError


def test_every_model_type_and_gguf_architecture_names_one_family() -> None:
    model_types = Counter(t for family in FAMILIES for t in family.model_types)
    assert [t for t, n in model_types.items() if n > 1] == []
    assert set(DECODERS) | set(ENCODERS) == set(model_types)
    architectures = Counter(
        arch for f in FAMILIES if isinstance(f, Family) for arch in f.gguf_architectures
    )
    assert [a for a, n in architectures.items() if n > 1] == []
    for family, model_type in GGUF_ARCHITECTURES.values():
        assert model_type in family.model_types
    for family in DECODERS.values():  # a multimodal config is read as its text model
        assert all(f"{t}_text" in family.model_types for t in family.multimodal)


def test_a_multimodal_checkpoints_text_weights_are_found_and_the_rest_skipped() -> None:
    for family in (gemma3.FAMILY, qwen3_5.FAMILY):
        name = "model.language_model.layers.0.mlp.down_proj.weight"
        assert family.weight_name(name) == "model.layers.0.mlp.down_proj.weight"
    assert gemma3.FAMILY.weight_name("vision_tower.blocks.0.weight") is None
    assert qwen3_5.FAMILY.weight_name("mtp.layers.0.mlp.down_proj.weight") is None
    # A family without a multimodal checkpoint reads every name as it stands.
    assert llama.FAMILY.weight_name("mtp.x") == "mtp.x"


def test_an_unknown_gguf_architecture_is_refused_with_the_registrys_list() -> None:
    with pytest.raises(UnsupportedModelError) as error:
        config_from_gguf({"general.architecture": "phi3"}, "model")
    assert all(arch in str(error.value) for arch in GGUF_ARCHITECTURES)
