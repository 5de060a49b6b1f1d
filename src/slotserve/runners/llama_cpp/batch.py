"""One ``llama_batch``, written through numpy views of its C arrays (one copy per chunk): the
step's chunks laid out row after row, with the rows whose outputs are read marked, and where
each chunk's samples and prompt log-probabilities will be found after the decode; and the
ballast that keeps a lone decode on the path batched decoding takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as llama
import numpy as np

from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.runners.llama_cpp.backend import FA_TILE_Q, SPLIT_KV_CONTEXT


def decode_groups(chunks: Sequence[ScheduledChunk]) -> list[list[ScheduledChunk]]:
    """The step's chunks in llama_decode calls: one call per LoRA adapter (llama.cpp applies
    adapters to the whole context) and chunk length.

    With per-sequence KV streams llama.cpp cuts a batch into sub-batches taking the same number
    of tokens from each of a run of consecutive sequence ids, so chunks of different lengths in
    one call would be cut into pieces sized by their neighbours, and attention rounds
    differently in pieces shorter than 64 tokens: a token's result would depend on what ran
    beside it. Grouped by length, every chunk runs whole or in pieces of 64 or more, in as
    many weight passes as llama.cpp would have made anyway. Multiples of 64 may share a call:
    llama.cpp's cuts then fall on multiples of 64."""
    groups: dict[tuple[int, int], list[ScheduledChunk]] = {}
    for chunk in sorted(chunks, key=lambda c: c.slot):
        length = len(chunk.token_ids)
        key = FA_TILE_Q if length % FA_TILE_Q == 0 else length
        groups.setdefault((chunk.adapter, key), []).append(chunk)
    return list(groups.values())


@dataclass
class Rows:
    """Where a filled batch's chunks stand."""

    count: int = 0
    sampling: list[tuple[ScheduledChunk, int]] = field(default_factory=list)  # first sample row
    scoring: list[tuple[ScheduledChunk, int]] = field(default_factory=list)  # prompt logprobs
    firsts: dict[int, int] = field(default_factory=dict)  # slot -> its chunk's first row


class DecodeBatch:
    """A batch of at most ``capacity`` tokens, one sequence id a token."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = llama.llama_batch_init(capacity, 0, 1)
        self._tokens = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self._positions = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self._n_seq_ids = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self._wants_logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self._seq_id_rows: list[Any] = [self.raw.seq_id[i] for i in range(capacity)]

    def fill(self, chunks: Sequence[ScheduledChunk]) -> Rows:
        """Lays the chunks out by slot; outputs only where a chunk samples (its last position
        and a verification chunk's draft positions) or scores its prompt."""
        rows = Rows()
        row = 0
        for chunk in sorted(chunks, key=lambda c: c.slot):
            size = len(chunk.token_ids)
            rows.firsts[chunk.slot] = row
            end = row + size
            if end > self.capacity:
                raise ValueError(f"batch of {end} tokens exceeds capacity {self.capacity}")
            self._tokens[row:end] = chunk.token_ids
            self._positions[row:end] = np.arange(chunk.start_pos, chunk.start_pos + size)
            self._wants_logits[row:end] = 0
            for i in range(row, end):
                self._seq_id_rows[i][0] = chunk.slot
            if chunk.sample:
                self._wants_logits[end - 1 - chunk.num_drafts : end] = 1
                rows.sampling.append((chunk, end - 1 - chunk.num_drafts))
            if chunk.prompt_logprob_targets:
                self._wants_logits[row : row + len(chunk.prompt_logprob_targets)] = 1
                rows.scoring.append((chunk, row))
            row = end
        self._n_seq_ids[:row] = 1
        self.raw.n_tokens = row
        rows.count = row
        return rows

    def output_every_row(self, count: int) -> None:
        """Every one of the first ``count`` rows outputs (embeddings are read from all)."""
        self._wants_logits[:count] = 1

    def free(self) -> None:
        llama.llama_batch_free(self.raw)


def ballast_for(
    group: Sequence[ScheduledChunk],
    num_slots: int,
    max_seq_len: int,
    kv_tokens: Callable[[int], int],
) -> list[ScheduledChunk]:
    """Throw-away tokens that keep one-token chunks off ggml's split-KV attention path.

    llama.cpp runs each run of consecutive sequence ids as its own sub-batch, and ggml's
    flash attention takes a split-KV path for a sub-batch of one query of one sequence
    over 512+ cells (padded from 256+ tokens of context), which rounds differently from
    the path batched decoding takes: a sequence decoding alone in its run would not match
    itself decoding beside others. For such a run, one token of a neighbouring slot
    joins it; the runner removes it from that slot's KV right after the forward (and puts
    back a hybrid model's recurrent state). It costs about one token's compute
    (benchmarks/RESULTS.md); shorter contexts never need it.
    """
    taken = {chunk.slot for chunk in group}
    ballast: list[ScheduledChunk] = []
    for chunk in sorted(group, key=lambda c: c.slot):
        slot = chunk.slot
        if chunk.start_pos < SPLIT_KV_CONTEXT or slot - 1 in taken or slot + 1 in taken:
            continue
        for neighbour in (slot + 1, slot - 1):
            if 0 <= neighbour < num_slots and neighbour not in taken:
                held = kv_tokens(neighbour)
                if held < max_seq_len:  # a full slot cannot take a token
                    ballast.append(ScheduledChunk(neighbour, [0], held, False))
                    taken.add(neighbour)
                    break
    return ballast
