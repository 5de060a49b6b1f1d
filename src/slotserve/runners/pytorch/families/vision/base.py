"""What a vision-language family's record holds of its images (``Family.vision``): the image
preparer, run where requests are rendered, and the vision tower, built by the runner from the
checkpoint's tensors. The runner's ``vision/`` package runs the tower between steps and puts
its embeddings into the decoder's inputs; it never asks which family it serves."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from slotserve.engine.images import ImageInput, ImagePreparer

# A checkpoint's tensors under their own names, one at a time (the tower keeps its own).
Tensors = Iterable[tuple[str, torch.Tensor]]


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


class Vision(Protocol):
    """A family's images. ``raw``: the checkpoint's whole ``config.json`` (its
    ``vision_config`` and image token)."""

    def preparer(self, folder: Path, raw: Mapping[str, Any]) -> ImagePreparer: ...

    def tower(
        self, raw: Mapping[str, Any], tensors: Tensors, device: torch.device, dtype: torch.dtype
    ) -> VisionTower:
        """The tower in the decoder's device and dtype, its weights taken from ``tensors``."""
        ...
