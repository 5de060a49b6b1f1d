"""Which vision-language checkpoints the runner reads images for, and their parts: the image
preparer (run where requests are rendered) and the tower (``VisionTower``), by
``model_type``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from slotserve.engine.images import ImageInput
from slotserve.runners.pytorch.vision.gemma3_vision import Gemma3Images, Gemma3Tower
from slotserve.runners.pytorch.vision.qwen_vl import TOWERS, QwenVlImages, QwenVlTower


class VisionTower(Protocol):
    # An image's tokens see each other both ways, so each image is computed in one chunk.
    whole_images: bool
    blocks: list[Any]  # the tower's blocks, for the stepped encoder's gates

    def check(self, image: ImageInput) -> None:
        """ValueError unless the image's placeholder count matches its pixels."""
        ...

    def positions(
        self, prompt_length: int, images: Sequence[ImageInput]
    ) -> tuple[np.ndarray[Any, Any] | None, int]:
        """Each prompt token's rotary positions (None: the decoder's own) and the ``delta``
        a later token's position is its index plus."""
        ...

    def encode(self, image: ImageInput) -> tuple[torch.Tensor, ...]: ...


def vision_config(folder: Path) -> dict[str, Any] | None:
    """A vision-language checkpoint's ``config.json``; None for a text model or a file."""
    config_file = folder / "config.json"
    if not folder.is_dir() or not config_file.is_file():
        return None
    raw: dict[str, Any] = json.loads(config_file.read_text())
    kind = raw.get("model_type")
    if (kind in TOWERS or kind == "gemma3") and "vision_config" in raw:
        return raw
    return None


def image_preparer(folder: Path, raw: dict[str, Any]) -> QwenVlImages | Gemma3Images:
    if raw["model_type"] == "gemma3":
        return Gemma3Images(folder, raw)
    return QwenVlImages(folder, raw)


def vision_tower(
    folder: Path, raw: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> VisionTower:
    if raw["model_type"] == "gemma3":
        return Gemma3Tower(folder, raw, device, dtype)
    return QwenVlTower(folder, raw, device, dtype)
