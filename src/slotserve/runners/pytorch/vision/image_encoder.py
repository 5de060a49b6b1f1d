"""The encoder cache (image embeddings by the image's digest) and the encodes the engine asked
for, run a piece at a time within the time it allows each step (``SteppedEncoder``), oldest
request first."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from functools import partial

import torch

from slotserve.engine.images import ImageInput
from slotserve.runners.pytorch.families.vision.base import VisionTower
from slotserve.runners.pytorch.vision.stepped_encoder import SteppedEncoder

# Image embeddings the encoder cache keeps once no sequence is using them (vLLM sizes its
# encoder cache in embeddings too).
ENCODER_CACHE_EMBEDDINGS = 32768


class ImageEncoder:
    def __init__(self, tower: VisionTower) -> None:
        self.tower = tower
        # By digest: the embeddings, then any deepstack features.
        self._cache: OrderedDict[str, tuple[torch.Tensor, ...]] = OrderedDict()
        self._cached_rows = 0
        self._queue: OrderedDict[str, ImageInput] = OrderedDict()  # asked for, oldest first
        self._stepped = SteppedEncoder(tower.blocks)
        self._allowance = 0.0  # seconds the encodes may still take (negative: overspent)
        self._piece_seconds = 0.0  # what the last piece took

    def ready(self, image: ImageInput) -> bool:
        return image.digest in self._cache

    def want(self, image: ImageInput) -> None:
        """Queues ``image``'s encode (once)."""
        if image.digest not in self._cache:
            self._queue.setdefault(image.digest, image)

    def keep_only(self, digests: set[str]) -> None:
        """Drops queued encodes no sequence needs any more (the one in progress finishes)."""
        for digest in [d for d in self._queue if d not in digests and d != self._stepped.key]:
            del self._queue[digest]

    def run(self, seconds: float) -> None:
        """Encodes queued images for about ``seconds`` (all of them when infinite): whole
        pieces, one more only while the allowance covers what the last one took. Time not
        spent is not saved up beyond a piece, and not at all while nothing is queued: a new
        image starts at the share's pace, not with a burst."""
        unbounded = math.isinf(seconds)
        if unbounded or not self._queue:
            self._allowance = min(self._allowance, 0.0)
        else:
            self._allowance = min(self._allowance + seconds, self._piece_seconds + seconds)
        while self._queue:
            digest, image = next(iter(self._queue.items()))
            if digest in self._cache:
                del self._queue[digest]
                continue
            if not unbounded and self._allowance < self._piece_seconds:
                return
            started = time.perf_counter()
            pieces = self._stepped.pieces if unbounded else 1
            result = self._stepped.advance(digest, partial(self.tower.encode, image), pieces)
            took = time.perf_counter() - started
            if not unbounded:
                self._allowance -= took
                self._piece_seconds = took
            if result is not None:
                self._store(image, result)
                del self._queue[digest]

    def get(self, image: ImageInput) -> tuple[torch.Tensor, ...]:
        """The image's embeddings and features: cached, else encoded now, whole (after the
        encode in progress, if another image's)."""
        cached = self._cache.get(image.digest)
        if cached is not None:
            self._cache.move_to_end(image.digest)
            return cached
        started = self._stepped.key
        if started is not None and started != image.digest:
            self._whole(self._queue.pop(started))
        return self._whole(image)

    def _whole(self, image: ImageInput) -> tuple[torch.Tensor, ...]:
        encode = partial(self.tower.encode, image)
        result = self._stepped.advance(image.digest, encode, self._stepped.pieces)
        assert result is not None, "every piece was allowed"
        return self._store(image, result)

    def _store(
        self, image: ImageInput, encoded: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        if any(t.shape[0] != image.length for t in encoded):
            raise ValueError("the vision tower gave a different number of embeddings")
        self._cache[image.digest] = encoded
        self._cached_rows += image.length
        while self._cached_rows > ENCODER_CACHE_EMBEDDINGS and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_rows -= dropped[0].shape[0]
        return encoded
