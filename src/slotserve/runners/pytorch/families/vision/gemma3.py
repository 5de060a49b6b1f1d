"""Gemma 3's images: transformers' PIL image processor (a square resize, run where requests
are rendered), the SigLIP vision tower and the projector that pools its patches into
``mm_tokens_per_image`` embeddings (transformers' own modules, their weights taken from the
checkpoint's tensors).

The chat template writes ``<start_of_image>`` where an image stands; as transformers'
processor does, the text there becomes a blank line, that token, one ``<image_soft_token>``
per embedding, ``<end_of_image>`` and a blank line before the prompt is tokenized. Positions
are the decoder's own; an image's tokens see each other both ways (``whole_images``), so
each image is computed within one prompt chunk.
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

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


@dataclass(frozen=True)
class Gemma3Vision:
    """Gemma 3's images (``Family.vision``)."""

    def preparer(self, folder: Path, raw: Mapping[str, Any]) -> Gemma3Images:
        return Gemma3Images(folder, raw)

    def tower(
        self, raw: Mapping[str, Any], tensors: Tensors, device: torch.device, dtype: torch.dtype
    ) -> Gemma3Tower:
        return Gemma3Tower(raw, tensors, device, dtype)


class Gemma3Images:
    """An image → its pixels and placeholder count (an :class:`ImageInput` at offset 0)."""

    def __init__(self, folder: Path, raw: Mapping[str, Any]) -> None:
        from transformers import Gemma3ImageProcessorPil

        processor: Any = (
            Gemma3ImageProcessorPil.from_pretrained(str(folder))
            if (folder / "preprocessor_config.json").is_file()
            else Gemma3ImageProcessorPil()
        )
        processor.do_pan_and_scan = False  # as transformers' Gemma3Processor sets it
        self.processor = processor
        self.image_token_id = int(raw["image_token_index"])  # the hub's and transformers' key
        self.length = int(raw.get("mm_tokens_per_image", 256))

    def prepare(self, image: Any) -> ImageInput:
        """``image``: an RGB ``PIL.Image``."""
        out = self.processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        data = pixels.tobytes()
        shape = tuple(int(n) for n in pixels.shape)
        return ImageInput(image_digest(data, shape, ()), 0, self.length, data, shape, ())

    def expand_text(self, text: str) -> str:
        """The rendered prompt with each image's marker written out as the model reads it."""
        return text.replace(BOI, f"\n\n{BOI}{SOFT * self.length}{EOI}\n\n")


def _tower_name(name: str) -> tuple[str, str] | None:
    """A checkpoint tensor's (module, name in it): the vision model's or the projector's."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):  # the hub's under ``vision_model.``, transformers' not
        return "vision", name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "projector", name.removeprefix("multi_modal_projector.")
    return None


class Gemma3Tower:
    """SigLIP and the projector, in the decoder's device and dtype."""

    whole_images = True

    def __init__(
        self, raw: Mapping[str, Any], tensors: Tensors, device: torch.device, dtype: torch.dtype
    ) -> None:
        from transformers import Gemma3Config, SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config: Any = Gemma3Config.from_dict(dict(raw))
        config.vision_config._attn_implementation = "sdpa"
        modules: dict[str, Any] = {
            "vision": SiglipVisionModel(config.vision_config),
            "projector": Gemma3MultiModalProjector(config),
        }
        weights: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}}
        for name, tensor in tensors:
            found = _tower_name(name)
            if found is not None:
                weights[found[0]][found[1]] = tensor
        for key, module in modules.items():
            module.load_state_dict(weights[key], strict=True)
            modules[key] = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.vision, self.projector = modules["vision"], modules["projector"]
        self.device, self.dtype = device, dtype
        self.blocks = list(self.vision.encoder.layers)
        self.length = int(config.mm_tokens_per_image)

    def check(self, image: ImageInput) -> None:
        if image.length != self.length or len(image.shape) != 4 or image.shape[0] != 1:
            raise ValueError("an image's placeholder count does not match its pixels")

    def positions(
        self, prompt_length: int, images: Sequence[ImageInput]
    ) -> tuple[np.ndarray[Any, Any] | None, int]:
        return None, 0  # the decoder's own

    def encode(self, image: ImageInput) -> tuple[torch.Tensor, ...]:
        """The image's embeddings, ``[image.length, hidden]``: one image per call."""
        pixels = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(image.shape)
        hidden = self.vision(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
        return (self.projector(hidden)[0],)
