"""Pooling a prompt's final hidden states into one embedding, chunk by chunk; both runners
hand it the rows it asks for (``ModelInfo.pooling`` names the kinds).

A prompt may be computed in several chunks, across several steps: mean pooling keeps a
running sum per slot (float64, so the order of the chunks does not change the vector beyond
float32's precision), first-token pooling keeps position 0's row, last-token pooling needs only
the prompt's last row. Mean and first-token prompts take no prefix-cache hit (the engine's
rule), so their first chunk starts at position 0, which starts the slot's pool afresh.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from slotserve.engine.runner_interface import ScheduledChunk

POOLINGS = ("last", "mean", "cls")

# sentence-transformers' ``1_Pooling/config.json`` switches, for the kinds served here.
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder names (its ``modules.json`` lists a Pooling
    module, whose folder holds the switches); None when it names none. Raises for a pooling
    served nowhere here (max, mean over sqrt(length), weighted)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    paths = [m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    if not paths or not (folder / paths[0] / "config.json").is_file():
        return None
    switches = json.loads((folder / paths[0] / "config.json").read_text())
    chosen = [kind for key, kind in _ST_MODES.items() if switches.get(key)]
    others = [
        key
        for key, value in switches.items()
        if key.startswith("pooling_mode_") and value and key not in _ST_MODES
    ]
    if others or len(chosen) != 1:
        raise ValueError(
            f"{folder}: the sentence-transformers pooling {sorted(others) or chosen} is not "
            f"supported (one of: {', '.join(_ST_MODES)})"
        )
    return chosen[0]


class PromptPools:
    """``finish`` makes a slot's result of its pooled state: a normalised vector by default, a
    reranker's score (``pytorch/step/score_head.py``)."""

    def __init__(
        self,
        pooling: str,
        finish: Callable[[np.ndarray[Any, Any]], list[float]] | None = None,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r} (known: {', '.join(POOLINGS)})")
        self.pooling = pooling
        self._finish = finish or normalised
        self._kept: dict[int, tuple[np.ndarray[Any, Any], int]] = {}  # slot -> (sum, count)
        self._done: dict[int, list[float]] = {}

    def rows(self, chunk: ScheduledChunk) -> tuple[int, int] | None:
        """Which of the chunk's positions (offsets ``[first, end)``) the pooling reads; None:
        none of them."""
        size = len(chunk.token_ids)
        if not chunk.embed:
            return None
        if self.pooling == "mean":
            return 0, size
        if self.pooling == "cls":
            return (0, 1) if chunk.start_pos == 0 else None
        return (size - 1, size) if chunk.embed_last else None

    def add(self, chunk: ScheduledChunk, hidden: np.ndarray[Any, Any] | None) -> None:
        """Takes the chunk's rows (those :meth:`rows` named, float) and, at the end of the
        prompt, makes the slot's vector."""
        slot = chunk.slot
        if chunk.start_pos == 0:
            self._kept.pop(slot, None)
        if hidden is not None:
            total, count = self._kept.get(slot, (np.zeros(hidden.shape[-1]), 0))
            self._kept[slot] = total + hidden.astype(np.float64).sum(axis=0), count + len(hidden)
        if chunk.embed_last:
            total, count = self._kept.pop(slot)
            self._done[slot] = self._finish(total / count)

    def take(self) -> dict[int, list[float]]:
        done, self._done = self._done, {}
        return done

    def forget(self, slot: int) -> None:
        self._kept.pop(slot, None)


def normalised(vector: np.ndarray[Any, Any]) -> list[float]:
    """L2-normalised float32 values (what OpenAI's base64 encoding carries exactly)."""
    norm = float(np.linalg.norm(vector))
    return (vector / max(norm, 1e-12)).astype(np.float32).tolist()  # type: ignore[no-any-return]
