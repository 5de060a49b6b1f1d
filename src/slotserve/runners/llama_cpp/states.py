"""A llama.cpp sequence's state in host memory: whole (what the prefix cache's host and disk
tiers keep), or its recurrent part alone (a hybrid model's snapshots), and how a step is cut so
that a snapshot is taken where the prefix cache asked for one.

Hybrid models (attention beside recurrent layers: Qwen3.5's Gated DeltaNet, Mamba...): a
sequence's recurrent state covers all its positions and cannot be trimmed to fewer, so the
prefix cache keeps copies of it taken at chosen positions (:class:`StateSnapshots`), in host
memory as llama.cpp serialises a sequence's recurrent part alone. A state exists only after a
whole ``llama_decode``, so a chunk is cut where one is wanted; cuts fall on the 64-token grid
anchored at position 0, where a chunk computes its tokens as a longer one would.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import llama_cpp as llama

from slotserve.engine.runner_interface import ScheduledChunk

# A sequence's state without its attention KV: the recurrent layers' (hybrid models).
RECURRENT_PART = llama.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


class SequenceStates:
    """Serialises the sequences of one llama.cpp context, and keeps a hybrid model's
    recurrent-state snapshots by place with the saves asked for ahead of the forward."""

    def __init__(self, ctx: Any, capacity: int) -> None:
        self._ctx = ctx
        self._snapshots: list[bytearray | None] = [None] * capacity
        self._pending: dict[int, dict[int, int]] = {}  # {slot: {position: place}}

    @property
    def capacity(self) -> int:
        return len(self._snapshots)

    @property
    def pending(self) -> bool:
        """Whether a save is asked for: a step without one runs uncut."""
        return bool(self._pending)

    def read(self, slot: int, flags: int = 0) -> bytearray:
        """The sequence's state (``flags=0``: whole; :data:`RECURRENT_PART`: that alone)."""
        size = llama.llama_state_seq_get_size_ext(self._ctx, slot, flags)
        data = bytearray(size)
        written = llama.llama_state_seq_get_data_ext(
            self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, slot, flags
        )
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of sequence {slot}")
        return data

    def write(self, slot: int, data: bytearray, flags: int = 0) -> bool:
        """Writes a state read by :meth:`read` into ``slot``; False when llama.cpp refused it
        (it has then emptied the sequence)."""
        size = len(data)
        read = llama.llama_state_seq_set_data_ext(
            self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, slot, flags
        )
        return bool(read)

    def ask(self, slot: int, position: int, snapshot: int) -> None:
        """Takes the slot's recurrent state into place ``snapshot`` once ``position`` is
        computed."""
        assert 0 <= snapshot < self.capacity
        self._pending.setdefault(slot, {})[position] = snapshot

    def forget(self, slot: int) -> None:
        """Drops the saves asked for by the sequence the slot held."""
        self._pending.pop(slot, None)

    def restore(self, slot: int, snapshot: int) -> None:
        # Read at once: the slot's stream can then be trimmed to the snapshot's position.
        data = self._snapshots[snapshot]
        assert data is not None, f"snapshot {snapshot} was never taken"
        if not self.write(slot, data, RECURRENT_PART):
            raise RuntimeError(f"llama.cpp could not restore a snapshot into sequence {slot}")

    def rounds(self, chunks: Sequence[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """The step's chunks, cut where a snapshot is wanted inside one: the pieces before
        each cut run in earlier rounds (one ``llama_decode`` per length and round)."""
        if not self._pending:
            return [list(chunks)]
        rounds: list[list[ScheduledChunk]] = []
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            wanted = self._pending.get(chunk.slot, {})
            cuts = sorted(p for p in wanted if chunk.start_pos < p < end)
            for depth, piece in enumerate(_cut(chunk, cuts)):
                if depth == len(rounds):
                    rounds.append([])
                rounds[depth].append(piece)
        return rounds

    def take(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Takes the snapshots wanted where the round's chunks end."""
        for chunk in chunks:
            wanted = self._pending.get(chunk.slot)
            if not wanted:
                continue
            end = chunk.start_pos + len(chunk.token_ids)
            snapshot = wanted.pop(end, None)
            if snapshot is not None:
                self._snapshots[snapshot] = self.read(chunk.slot, RECURRENT_PART)
            # A position passed would leave its place unwritten: the cache asks only ahead.
            assert all(p > end for p in wanted), f"slot {chunk.slot}: {sorted(wanted)} passed"
            if not wanted:
                del self._pending[chunk.slot]


def _cut(chunk: ScheduledChunk, cuts: Sequence[int]) -> list[ScheduledChunk]:
    """``chunk`` as pieces ending at each of ``cuts`` (positions inside it) and at its end; the
    last piece samples, the others only compute (and score their prompt log-probabilities)."""
    pieces = []
    start = chunk.start_pos
    for cut in [*cuts, chunk.start_pos + len(chunk.token_ids)]:
        offset, size = start - chunk.start_pos, cut - start
        pieces.append(
            replace(
                chunk,
                token_ids=chunk.token_ids[offset : offset + size],
                start_pos=start,
                prompt_logprob_targets=chunk.prompt_logprob_targets[offset : offset + size],
            )
        )
        start = cut
    last = pieces[-1]
    pieces[:-1] = [
        replace(p, sample=False, num_drafts=0, allowed_tokens=None, embed_last=False)
        for p in pieces[:-1]
    ]
    return [*pieces[:-1], last]
