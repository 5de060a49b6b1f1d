"""Incremental, UTF-8 safe detokenization with stop-string hold-back.

Token pieces arrive as raw bytes (byte-fallback tokens may carry a fraction of a code point),
so bytes go through an incremental UTF-8 decoder that keeps an incomplete tail until the rest
arrives: a stream never emits a broken code point.

Text that could still turn into a stop string is held back until it either completes the stop
string (then it is cut, never emitted) or stops matching (then it is released)::

    text:      "... the answer is 42</"      stop = ["</end>"]
    emitted:   "... the answer is 42"        held back: "</" (a prefix of "</end>")
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._emitted = 0  # characters of _text already handed out
        self._searched = 0  # stop strings cannot start before this index (already searched)
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text decoded so far, cut at a matched stop string."""
        return self._text

    def add_token(self, token_id: int) -> None:
        """Appends one token's bytes; afterwards ``matched_stop`` tells whether a stop matched."""
        if self.matched_stop is not None:
            return
        piece = self._decoder.decode(self._token_bytes(token_id))
        if not piece:
            return
        self._text += piece
        if self._stop:
            self._find_stop()

    def take_delta(self, final: bool = False) -> str:
        """Returns the text that is safe to emit now; ``final`` flushes everything held back."""
        if final and self.matched_stop is None:
            self._text += self._decoder.decode(b"", final=True)
        end = len(self._text)
        if not final and self.matched_stop is None:
            end -= self._held_back_chars()
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> None:
        start = max(0, self._searched - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            self._text = self._text[: best[0]]
            self.matched_stop = best[1]
        self._searched = len(self._text)

    def _held_back_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        if not self._stop:
            return 0
        longest = 0
        tail = self._text[-self._max_stop_len :]
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:size]):
                    longest = size
                    break
        return longest
