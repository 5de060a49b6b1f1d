"""A model's image encodes as the engine schedules them: the encodes run between steps, and
invariant 11 of the scheduler (``scheduler.py`` lists them all).

11. A prompt chunk ends before the first image whose encode is not done (``images_ready``);
    the encodes run between steps (:meth:`EncoderWork.run_between_steps`, called by the engine
    core), so none lengthens a step beyond its share. Where an image's tokens see the whole
    image (Gemma 3), no chunk ends inside one (``chunk_end``): it ends before the image, or
    waits until the rest of the image fits.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from slotserve.engine.images import ImageInput, ImageInputs, encoder_seconds
from slotserve.engine.request import Sequence


class EncoderWork:
    """The images of a runner that reads them (engine thread only). ``share``: the part of the
    engine's time encodes may take while sequences decode (``--encoder-share``)."""

    def __init__(self, inputs: ImageInputs, share: float) -> None:
        self.inputs = inputs
        self.share = share

    def add(self, slot: int, images: SequenceOf[ImageInput]) -> None:
        """The images of the sequence the runner starts next in ``slot``."""
        self.inputs.add_images(slot, images)

    def run_between_steps(self, decoding: bool, last_step_seconds: float) -> None:
        """Runs the queued encodes, within the share streams allow while any sequence
        decodes (steps like the last one beside them), else all of them."""
        self.inputs.encode_images(encoder_seconds(self.share, decoding, last_step_seconds))

    def ready(self, slot: int, seq: Sequence, rest: int) -> int:
        """Invariant 11: how many of the ``rest`` prompt tokens ``seq`` has left to compute
        may be computed now (an encode not yet done is queued)."""
        if not seq.request.submitted.images:
            return rest
        start = seq.num_computed_tokens
        return min(rest, self.inputs.images_ready(slot, start) - start)

    def chunk_size(self, slot: int, seq: Sequence, size: int) -> int:
        """Invariant 11: ``size`` cut so that ``seq``'s next chunk never ends inside an image
        whose tokens see the whole image."""
        if not size or not seq.request.submitted.images:
            return size
        start = seq.num_computed_tokens
        return self.inputs.chunk_end(slot, start, start + size) - start
