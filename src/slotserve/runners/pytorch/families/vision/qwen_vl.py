"""Qwen2.5-VL's and Qwen3-VL's images: the HF image processor's patches (run where requests
are rendered), the vision tower (transformers' own module, its weights read from the
checkpoint's tensors) and the decoder's M-RoPE positions; each Qwen-VL family's record names
its transformers classes (:class:`QwenVlVision`).

The tower turns an image of ``t × h × w`` patches into ``t·h·w / merge²`` embeddings, one per
placeholder token (Qwen3-VL's also gives its "deepstack" features, as many per token, which
the decoder adds after its first layers). M-RoPE gives each token three positions (time,
height, width): text tokens have all three equal; an image's tokens count time, row and
column from where the image starts; text after an image continues from the image's largest
position plus one, so a sequence's positions run behind its length by a fixed ``delta``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.engine.images import ImageInput, image_digest
from slotserve.runners.pytorch.families.vision.base import Tensors

# Where the tower's weights stand: transformers 5's layout, then the hub's older one.
_TOWER_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class QwenVlVision:
    """A Qwen-VL family's images (``Family.vision``): transformers' names for its model's
    module, its configuration class and its tower's class."""

    module: str
    config_class: str
    tower_class: str

    def preparer(self, folder: Path, raw: Mapping[str, Any]) -> QwenVlImages:
        return QwenVlImages(folder, raw)

    def tower(
        self, raw: Mapping[str, Any], tensors: Tensors, device: torch.device, dtype: torch.dtype
    ) -> QwenVlTower:
        return QwenVlTower(self, raw, tensors, device, dtype)


class QwenVlImages:
    """An image → its patches and placeholder count (an :class:`ImageInput` at offset 0)."""

    def __init__(self, folder: Path, raw: Mapping[str, Any]) -> None:
        from transformers import Qwen2VLImageProcessorPil

        self.processor = (
            Qwen2VLImageProcessorPil.from_pretrained(str(folder))
            if (folder / "preprocessor_config.json").is_file()
            else Qwen2VLImageProcessorPil()
        )
        self.image_token_id = int(raw["image_token_id"])
        self.merge = int(raw["vision_config"].get("spatial_merge_size", 2))

    def prepare(self, image: Any) -> ImageInput:
        """``image``: an RGB ``PIL.Image``."""
        out = self.processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        data = pixels.tobytes()
        length = grid[0] * grid[1] * grid[2] // self.merge**2
        return ImageInput(
            image_digest(data, pixels.shape, grid), 0, length, data, pixels.shape, grid
        )

    def expand_text(self, text: str) -> str:
        return text  # the template writes one placeholder per image; the server repeats it


def mrope_positions(
    prompt_length: int, images: Sequence[ImageInput], merge: int
) -> tuple[np.ndarray[Any, Any], int]:
    """Each prompt token's (time, height, width) positions, ``[3, prompt_length]``, and the
    ``delta`` a later token's position (all three) is its index plus."""
    positions = np.empty((3, prompt_length), dtype=np.int64)
    next_position, done = 0, 0
    for image in images:
        text = image.offset - done
        positions[:, done : image.offset] = next_position + np.arange(text)
        next_position += text
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        grids = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        for axis, grid in enumerate(grids):
            positions[axis, image.offset : image.end] = next_position + grid.ravel()
        next_position = int(positions[:, image.offset : image.end].max()) + 1
        done = image.end
    positions[:, done:] = next_position + np.arange(prompt_length - done)
    return positions, next_position + prompt_length - done - prompt_length


class QwenVlTower:
    """The vision tower, in the decoder's device and dtype."""

    whole_images = False  # an image's tokens attend causally, as text

    def __init__(
        self,
        vision: QwenVlVision,
        raw: Mapping[str, Any],
        tensors: Tensors,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        import importlib

        models = importlib.import_module(f"transformers.models.{vision.module}")
        config: Any = getattr(models, vision.config_class).from_dict(dict(raw)).vision_config
        config._attn_implementation = "sdpa"
        tower: Any = getattr(models, vision.tower_class)(config)
        weights = {}
        for name, tensor in tensors:
            for prefix in _TOWER_PREFIXES:
                if name.startswith(prefix):
                    weights[name[len(prefix) :]] = tensor
        tower.load_state_dict(weights, strict=True)
        self.tower = tower.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.merge = int(config.spatial_merge_size)
        self.blocks = list(self.tower.blocks)

    def check(self, image: ImageInput) -> None:
        if len(image.grid) != 3 or image.length * self.merge**2 != int(np.prod(image.grid)):
            raise ValueError("an image's placeholder count does not match its patches")

    def positions(
        self, prompt_length: int, images: Sequence[ImageInput]
    ) -> tuple[np.ndarray[Any, Any] | None, int]:
        return mrope_positions(prompt_length, images, self.merge)

    def encode(self, image: ImageInput) -> tuple[torch.Tensor, ...]:
        """The image's embeddings, ``[image.length, hidden]``, then its deepstack features
        (as many): one image per call, so that they never depend on what else is encoded."""
        pixels = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(image.shape)
        grid = torch.tensor([image.grid], dtype=torch.int64, device=self.device)
        out = self.tower(hidden_states=pixels.to(self.device, self.dtype), grid_thw=grid)
        return (out.pooler_output, *(getattr(out, "deepstack_features", None) or ()))
