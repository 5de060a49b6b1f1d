"""Images in a prompt as the engine sees them (:class:`ImageInput`), and how the prefix cache
keeps KV computed over one image apart from another's (:func:`image_cache_keys`).

A prompt with images holds, for each, a run of placeholder tokens (the model's image token,
repeated as many times as the encoder gives it embeddings). The runner replaces those
positions' embeddings with the image's; the engine schedules them like any prompt tokens and
knows only where each run is and which image fills it: the pixels are the runner's to read.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from slotserve.engine.errors import InvalidRequestError

# An image's cache keys are negative: token ids (and an adapter's keys) never are.
_KEY_BITS = 62


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: its placeholder run and the pixels the runner encodes."""

    # A hash of what the encoder reads (pixels and layout): two images whose KV may be shared
    # have the same digest, two that differ never do.
    digest: str
    offset: int  # the run's first position in the prompt
    length: int  # its placeholder tokens (one per embedding the encoder gives)
    pixels: bytes  # float32, in the runner's processor's layout
    shape: tuple[int, ...]  # of ``pixels``
    grid: tuple[int, ...]  # the model's image layout (Qwen-VL: temporal, height, width patches)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_digest(pixels: bytes, shape: Sequence[int], grid: Sequence[int]) -> str:
    digest = hashlib.blake2b(pixels, digest_size=16)
    digest.update(repr((tuple(shape), tuple(grid))).encode())
    return digest.hexdigest()


def image_cache_keys(
    keys: Sequence[int], images: Sequence[ImageInput], adapter_id: int
) -> Sequence[int]:
    """``keys`` (a prompt's, as ``adapters.cache_keys`` gives them) with each image's run
    replaced by keys derived from the image (and the adapter): two prompts whose text is the
    same but whose images differ part at the first placeholder."""
    if not images:
        return keys
    folded = list(keys)
    for image in images:
        if image.offset >= len(folded):
            break
        seed = f"{image.digest}:{adapter_id}".encode()
        key = -1 - (int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest()) >> 2)
        assert -key <= 1 << _KEY_BITS
        end = min(image.end, len(folded))
        folded[image.offset : end] = [key] * (end - image.offset)
    return folded


def encoder_seconds(share: float, decoding: bool, last_step_seconds: float) -> float:
    """What the queued encodes may take before this step: while sequences decode, what keeps
    encodes to ``share`` of the engine's time beside steps like the last, else all they need
    (no stream waits on them)."""
    if not decoding:
        return math.inf
    return share / (1 - share) * last_step_seconds


def check_images(
    images: Sequence[ImageInput],
    prompt_token_ids: Sequence[int],
    accepts: bool,
    whole_limit: int | None = None,
) -> None:
    """``InvalidRequestError`` unless every run lies in the prompt, in order, without overlap,
    on a model that reads images; ``whole_limit``: the most tokens an image computed within
    one chunk may have (where its tokens see the whole image)."""
    if not images:
        return
    if not accepts:
        raise InvalidRequestError(
            "this model reads text only: images are not accepted", param="messages"
        )
    end = 0
    for image in images:
        if image.offset < end or image.length <= 0 or image.end > len(prompt_token_ids):
            raise InvalidRequestError("an image's placeholder tokens fall outside the prompt")
        if whole_limit is not None and image.length > whole_limit:
            raise InvalidRequestError(
                f"an image takes {image.length} tokens, computed in one prompt chunk; this "
                f"server's chunks hold at most {whole_limit} (--prefill-chunk, "
                "--max-batch-tokens less --slots)",
                param="messages",
            )
        end = image.end


class ImagePreparer(Protocol):
    """A vision-language model's image processing, run where requests are rendered: the
    rendered prompt's text is expanded (``expand_text``), then wherever its tokens hold
    ``image_token_id`` once per image the server repeats it to the image's ``length``
    (runs already that long stay)."""

    image_token_id: int

    def prepare(self, image: Any) -> ImageInput:
        """An RGB ``PIL.Image`` as the model reads it (``offset`` 0)."""
        ...

    def expand_text(self, text: str) -> str:
        """The rendered prompt with each image's marker written out as the model reads it."""
        ...


@runtime_checkable
class ImageTokenizer(Protocol):
    """A tokenizer that knows how its model reads images."""

    image_preparer: ImagePreparer | None


class ImageInputs(Protocol):
    """What a runner that reads images keeps of them: each sequence's, and the encodes the
    engine schedules between steps."""

    def add_images(self, slot: int, images: Sequence[ImageInput]) -> None:
        """The images of the sequence :meth:`Runner.add_sequence` starts next in ``slot``;
        held until its ``remove_sequence``."""
        ...

    def images_ready(self, slot: int, start: int) -> int:
        """How far the prompt of ``slot``'s sequence, computed up to ``start``, may be
        computed now: the start of the first image it needs whose encode is not done (which
        is then queued), or more than any prompt's length."""
        ...

    def chunk_end(self, slot: int, start: int, end: int) -> int:
        """Where a chunk of ``slot``'s prompt from ``start`` may end, at most ``end``: never
        inside an image whose tokens see the whole image."""
        ...

    def encode_images(self, seconds: float) -> None:
        """Runs the queued encodes, oldest first, for about ``seconds`` (all of them when
        infinite)."""
        ...


@runtime_checkable
class ImageRunner(Protocol):
    """A runner that reads images (``ModelInfo.accepts_images``)."""

    @property
    def image_inputs(self) -> ImageInputs | None: ...
