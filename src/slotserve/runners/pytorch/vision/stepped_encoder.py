"""The vision tower run a few blocks at a time, between engine steps, so that encoding a large
image never holds up the running streams for longer than the engine allows.

The tower is transformers' module, whose forward runs all its blocks in one call. It runs in
a worker thread whose every block first waits for a permit; the engine thread hands out
permits and waits until they are used (or the image is done), so the two never compute at
once. Every encode runs here, on one thread: a second OpenMP team beside the engine's slowed
its decode steps by 1.8× even while parked, and one place gives every image the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

Encode = Callable[[], tuple[torch.Tensor, ...]]


class SteppedEncoder:
    def __init__(self, blocks: Any) -> None:
        """``blocks``: the tower's blocks (each gets a gate before its forward)."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._permits = 0
        self._paused = False
        self._result: tuple[torch.Tensor, ...] | None = None
        self._error: BaseException | None = None
        self.key: str | None = None  # what the encode in progress is of
        for block in blocks:
            block.register_forward_pre_hook(self._gate)

    def _gate(self, module: Any, args: Any) -> None:
        if threading.current_thread() is not self._thread:
            return  # the tower called directly (a reference)
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._permits > 0)
            self._permits -= 1
            self._paused = False

    def _run(self, encode: Encode) -> None:
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                result = encode()
        except BaseException as exc:  # handed to the engine thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            return
        with self._cond:
            self._result = result
            self._cond.notify_all()

    def advance(self, key: str, encode: Encode, blocks: int) -> tuple[torch.Tensor, ...] | None:
        """Runs ``blocks`` more blocks of the encode of ``key`` (started by ``encode`` when
        none is in progress); its result once it is done, else None."""
        if self._thread is None:
            self.key, self._result, self._error, self._permits = key, None, None, 0
            self._thread = threading.Thread(target=self._run, args=(encode,), daemon=True)
            self._thread.start()
        assert key == self.key, "one encode at a time"
        with self._cond:
            self._permits += blocks
            self._cond.notify_all()
            self._cond.wait_for(
                lambda: (
                    self._result is not None
                    or self._error is not None
                    or (self._paused and self._permits == 0)
                )
            )
            result, error = self._result, self._error
        if result is None and error is None:
            return None
        self._thread.join()
        self._thread, self.key = None, None
        if error is not None:
            raise error
        return result
