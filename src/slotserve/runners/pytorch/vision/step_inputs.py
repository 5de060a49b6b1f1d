"""What a step of a vision-language model adds to the decoder's inputs: the embeddings of the
image positions its chunks cover (``image_encoder.py``: encoded once per image, between
steps as the engine allows, kept by the image's digest), every token's M-RoPE positions
(Qwen-VL) and the image tokens that see their whole image (Gemma 3).

A chunk may cover part of an image's placeholder run (prompts are cut into chunks wherever
the scheduler's budget ends; not Gemma 3's, see :meth:`VisionInputs.chunk_end`): the image's
rows are taken as the chunks reach them. The engine asks :meth:`VisionInputs.images_ready`
how far a sequence's prompt may run: up to the first image not yet encoded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from slotserve.engine.images import ImageInput
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.runners.pytorch.families.vision.base import VisionTower
from slotserve.runners.pytorch.load.checkpoint import Checkpoint
from slotserve.runners.pytorch.model.decoder import StepImages
from slotserve.runners.pytorch.vision.image_encoder import ImageEncoder


class _Slot:
    def __init__(
        self, images: Sequence[ImageInput], positions: np.ndarray[Any, Any] | None, delta: int
    ):
        self.images, self.positions, self.delta = images, positions, delta


class VisionInputs:
    def __init__(self, tower: VisionTower, device: torch.device) -> None:
        self.tower, self.device = tower, device
        self._pending: dict[int, Sequence[ImageInput]] = {}
        self._slots: dict[int, _Slot] = {}
        self.encoder = ImageEncoder(tower)

    @classmethod
    def load(
        cls, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, ranks: int
    ) -> VisionInputs | None:
        """For a vision-language checkpoint, its family's tower; None for a text model."""
        vision = checkpoint.vision
        if vision is None:
            return None
        if ranks > 1:
            raise ValueError("a vision-language model is not served under tensor parallelism")
        tower = vision.tower(checkpoint.raw_config, checkpoint.tensors(), device, dtype)
        return cls(tower, device)

    def add_images(self, slot: int, images: Sequence[ImageInput]) -> None:
        for image in images:
            self.tower.check(image)
        self._pending[slot] = images

    def start(self, slot: int, prompt_length: int) -> None:
        """The sequence starting in ``slot`` (its images given just before, if any)."""
        images = self._pending.pop(slot, ())
        positions, delta = self.tower.positions(prompt_length, images)
        self._slots[slot] = _Slot(images, positions, delta)

    def forget(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._pending.pop(slot, None)
        self.encoder.keep_only({i.digest for s in self._slots.values() for i in s.images})

    def images_ready(self, slot: int, start: int) -> int:
        """How far the prompt of ``slot``'s sequence, computed up to ``start``, may run now:
        up to the first image it still needs whose encode is not done (queued here)."""
        entry = self._slots.get(slot)
        for image in entry.images if entry is not None else ():
            if image.end > start and not self.encoder.ready(image):
                self.encoder.want(image)
                return max(image.offset, start)
        return sys.maxsize

    def chunk_end(self, slot: int, start: int, end: int) -> int:
        """Where a chunk of ``slot``'s prompt from ``start`` may end, at most ``end``: where
        an image's tokens see their whole image, never inside one (before it, or ``start``:
        none this step, when the chunk would begin inside it)."""
        entry = self._slots.get(slot)
        if entry is None or not self.tower.whole_images:
            return end
        for image in entry.images:
            if image.offset < end < image.end:
                return max(image.offset, start)
        return end

    def encode_images(self, seconds: float) -> None:
        """Runs queued encodes for about ``seconds`` (see ``ImageEncoder.run``)."""
        self.encoder.run(seconds)

    def step(self, ordered: Sequence[ScheduledChunk]) -> StepImages:
        """The inputs of a step of ``ordered`` chunks (in the plan's row order)."""
        positions: list[np.ndarray[Any, Any]] = []
        rows: list[torch.Tensor] = []
        encoded: list[tuple[torch.Tensor, ...]] = []  # the rows' embeddings and features
        runs: list[tuple[int, int]] = []
        row = 0
        for chunk in ordered:
            start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            slot = self._slots[chunk.slot]
            if slot.positions is not None:
                positions.append(_rope_span(slot, start, end))
            for image in slot.images:
                first, last = max(start, image.offset), min(end, image.end)
                if first < last:
                    whole = self.encoder.get(image)
                    encoded.append(
                        tuple(t[first - image.offset : last - image.offset] for t in whole)
                    )
                    rows.append(torch.arange(row + first - start, row + last - start))
                    if self.tower.whole_images:
                        assert last == image.end, "an image is computed in one chunk"
                        runs.append((row + first - start, last - first))
            row += end - start
        rope = (
            torch.from_numpy(np.concatenate(positions, axis=1)).to(self.device)
            if positions
            else None
        )
        if not rows:
            return StepImages(rope, None, None)
        embeds, *deepstack = (torch.cat(parts) for parts in zip(*encoded, strict=True))
        return StepImages(
            rope, torch.cat(rows).to(self.device), embeds, tuple(deepstack), tuple(runs)
        )


def _rope_span(slot: _Slot, start: int, end: int) -> np.ndarray[Any, Any]:
    """M-RoPE positions ``[3, end - start]`` of a chunk: the prompt's, then past it each
    token's index plus the slot's delta."""
    assert slot.positions is not None
    prompt = slot.positions.shape[1]
    span = np.empty((3, end - start), dtype=np.int64)
    inside = min(end, prompt) - start
    if inside > 0:
        span[:, :inside] = slot.positions[:, start : start + inside]
    after = max(inside, 0)
    span[:, after:] = np.arange(start + after, end) + slot.delta
    return span
