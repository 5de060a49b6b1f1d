"""The vision tower run a piece at a time, between engine steps, so that encoding a large image
never holds up the running streams for much longer than a step.

The tower is transformers' module, whose forward runs all its blocks in one call. It runs in
a greenlet whose every piece (the work before each linear layer of its blocks: a whole block
would stall the streams for several decode steps) first takes a permit, switching back to
the engine when none is left; the engine hands out permits and switches in. A greenlet
rather than a thread: the encode runs on the engine's own thread and OpenMP team, at full
width, and the two never compute at once. A second thread's OpenMP team slows the engine's
decode steps even while it is parked, and a one-thread encoder takes far longer per image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import greenlet
import torch

Encode = Callable[[], tuple[torch.Tensor, ...]]


class SteppedEncoder:
    def __init__(self, blocks: Any) -> None:
        """``blocks``: the tower's blocks (each linear layer in them takes a permit)."""
        self._encode: greenlet.greenlet | None = None
        self._permits = 0
        self.key: str | None = None  # what the encode in progress is of
        gated = [m for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear)]
        for module in gated:
            module.register_forward_pre_hook(self._gate)
        self.pieces = len(gated)  # of an encode: the permits it takes, at most

    def _gate(self, module: Any, args: Any) -> None:
        current = self._encode
        if current is None or greenlet.getcurrent() is not current:
            return  # the tower called directly (a reference)
        if self._permits == 0:
            assert current.parent is not None
            current.parent.switch()  # back to ``advance``, until it grants more
        self._permits -= 1

    def advance(self, key: str, encode: Encode, pieces: int) -> tuple[torch.Tensor, ...] | None:
        """Runs ``pieces`` more pieces of the encode of ``key`` (started by ``encode`` when
        none is in progress); its result once it is done, else None. Always called from the
        same thread."""
        if self._encode is None:
            self.key, self._encode = key, greenlet.greenlet(encode)
        assert key == self.key, "one encode at a time"
        self._permits = pieces
        try:
            # Grad mode is thread state the engine and the encode share: set for each stretch
            # here rather than held across switches inside the greenlet.
            with torch.inference_mode():
                result = self._encode.switch()
        except BaseException:
            self._encode, self.key = None, None
            raise
        if not self._encode.dead:
            return None
        self._encode, self.key = None, None
        return result  # type: ignore[no-any-return]
