"""An HF model folder, as the load plan reads a checkpoint (``checkpoint.py``): ``config.json``
read by its family, the weights of ``model.safetensors`` or of the shards its index lists, the
recommended sampling of ``generation_config.json``, the tokenizer (with a vision-language
family's image preparer), the pooling a sentence-transformers folder names. A folder of 4-bit
AWQ, GPTQ or compressed-tensors weights gives each projection's as one tensor
(``int4_checkpoint.py``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults, from_generation_config
from slotserve.runners.pooling import sentence_transformers_pooling
from slotserve.runners.pytorch.families.registry import config_from_hf, vision_of
from slotserve.runners.pytorch.families.vision.base import Vision
from slotserve.runners.pytorch.load.int4_checkpoint import Int4Scheme, int4_scheme, int4_tensors
from slotserve.runners.pytorch.load.tokenizer import HfTokenizer
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.quant.tensor import QuantTensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HfFolder:
    """Nothing is read until it is asked for."""

    path: Path
    overrides: str | None = None  # --hf-overrides: a JSON object laid over config.json's settings

    @property
    def name(self) -> str:
        return self.path.name

    @cached_property
    def raw_config(self) -> Mapping[str, Any]:
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} has no config.json")
        raw: dict[str, Any] = json.loads(config_file.read_text())
        return raw

    @cached_property
    def int4(self) -> Int4Scheme | None:
        """The 4-bit scheme of its weights, if quantized (a quantization not read: refused)."""
        return int4_scheme(self.raw_config)

    @cached_property
    def config(self) -> ModelConfig:
        overrides = json.loads(self.overrides) if self.overrides else None
        config = config_from_hf(self.raw_config, self.name, overrides)
        _ = self.int4  # a quantization it cannot read: refused before any weight
        return config

    @property
    def vision(self) -> Vision | None:
        return vision_of(self.raw_config) if (self.path / "config.json").is_file() else None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Dense: a quantized projection's weight dequantized to float32."""
        tensors = safetensors_tensors(self.path)
        if self.int4 is None:
            return tensors
        return int4_tensors(tensors, self.int4, keep_quantized=False)  # type: ignore[return-value]

    def quantized_tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """As :meth:`tensors`, but a quantized projection's weight as its blocks."""
        assert self.int4 is not None, "only a quantized checkpoint has blocks of its own"
        return int4_tensors(safetensors_tensors(self.path), self.int4, keep_quantized=True)

    def quantized_types(self) -> set[str]:
        """The block types its matrices may be kept in as stored (none unless quantized)."""
        return set() if self.int4 is None else self.int4.kinds

    def tokenizer(self) -> HfTokenizer:
        tokenizer = HfTokenizer.from_folder(self.path)
        vision = self.vision
        if vision is not None:
            tokenizer.image_preparer = vision.preparer(self.path, self.raw_config)
        return tokenizer

    def sampling_defaults(self) -> SamplingDefaults:
        """``generation_config.json``'s sampling over vLLM's neutral defaults, as vLLM's
        ``--generation-config auto`` applies them."""
        config_file = self.path / "generation_config.json"
        try:
            raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, ValueError) as exc:
            # Only advice: a broken file must not stop the model from serving.
            logger.warning("ignoring %s: %s", config_file, exc)
            raw = {}
        own = from_generation_config(raw) if isinstance(raw, dict) else SamplingDefaults()
        return own.over(NEUTRAL)

    def pooling(self) -> str | None:
        return sentence_transformers_pooling(self.path)


def safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json``
    lists, one at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor an index of shards")
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, shard.get_tensor(name)
