"""Mistral (``mistral``): Llama's decoder where every layer may attend through a sliding
window. Its GGUF files are converted as ``llama`` and read by that family."""

from __future__ import annotations

from slotserve.runners.pytorch.families.base import Family, HfConfig
from slotserve.runners.pytorch.model.config import ModelConfig


def _config(hf: HfConfig) -> ModelConfig:
    window = hf.raw.get("sliding_window")
    return hf.decoder(
        sliding_window=int(window) if window else None,
        sliding_layers=(True,) * hf.layers if window else (),
    )


FAMILY = Family(model_types=("mistral",), config=_config)
