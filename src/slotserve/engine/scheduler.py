"""Decides, each step, which tokens of which sequences go into the one forward pass (SPEC E3).

Works on ints and lists only: slot indices, token counts and token-id slices.

Batch-construction invariants:

1. Every GENERATING slot contributes exactly one decode token, every step.
2. PREFILLING slots then share what is left of ``max_batch_tokens``, oldest admission first,
   each taking at most ``prefill_chunk`` tokens; so running streams wait at most one chunk.
3. A sequence appears at most once per batch, with contiguous positions starting at its
   ``num_computed_tokens``.
4. A request with ``n`` sequences is admitted only when ``n`` slots are free (FIFO: a large
   request is not overtaken, so it cannot starve).
5. ``max_batch_tokens > num_slots`` (validated in ``EngineConfig``), so prefill progresses.
6. When the runner asks for equal prefill chunks (``ModelInfo.equal_prefill_chunks``), the
   chunks chosen by invariant 2 are trimmed to the shortest whole one (a chunk the budget cut
   short does not count as whole). llama.cpp with per-sequence KV streams cuts a batch into
   sub-batches that take the same number of tokens from each sequence; ragged chunk ends (40, 41, 42
   tokens...) would cost one extra weight pass each, while trimmed chunks leave the few
   leftover tokens to ride along with later decode steps. Oldest-first order is kept, so a
   long prompt still finishes before the ones queued behind it start.
"""

from __future__ import annotations

from collections import deque

from slotserve.engine.config import EngineConfig
from slotserve.engine.request import Request, Sequence
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.engine.slots import Slot, SlotPool, SlotState


class Scheduler:
    def __init__(self, config: EngineConfig, equal_prefill_chunks: bool = False) -> None:
        self.config = config
        self.equal_prefill_chunks = equal_prefill_chunks
        self.slots = SlotPool(config.num_slots)
        self.waiting: deque[Request] = deque()
        self._prefill_order: list[Slot] = []  # PREFILLING slots, oldest admission first

    def admit(self) -> list[Sequence]:
        """Moves waiting requests into free slots; returns the newly placed sequences."""
        placed: list[Sequence] = []
        while self.waiting and len(self.waiting[0].sequences) <= self.slots.num_free:
            request = self.waiting.popleft()
            for sequence in request.sequences:
                slot = self.slots.acquire(sequence)
                self._prefill_order.append(slot)
                placed.append(sequence)
        return placed

    def schedule(self) -> list[ScheduledChunk]:
        """Builds the next batch; an empty list means there is nothing to run."""
        chunks: list[ScheduledChunk] = []
        budget = self.config.max_batch_tokens
        for slot in self.slots.slots:
            if slot.state is SlotState.GENERATING:
                seq = _sequence(slot)
                pos = seq.num_computed_tokens
                chunks.append(ScheduledChunk(slot.index, seq.token_ids[pos : pos + 1], pos, True))
                budget -= 1
        for slot, size in zip(self._prefill_order, self._prefill_sizes(budget), strict=True):
            if size == 0:
                break
            seq = _sequence(slot)
            start = seq.num_computed_tokens
            end = start + size
            chunks.append(
                ScheduledChunk(slot.index, seq.token_ids[start:end], start, end == seq.num_tokens)
            )
            budget -= size
        return chunks

    def _prefill_sizes(self, budget: int) -> list[int]:
        """Prompt tokens for each PREFILLING slot this step, oldest first (0: none)."""
        sizes, truncated = [], False
        for slot in self._prefill_order:
            seq = _sequence(slot)
            wanted = min(seq.num_tokens - seq.num_computed_tokens, self.config.prefill_chunk)
            size = min(wanted, budget)
            truncated = truncated or size < wanted
            sizes.append(size)
            budget -= size
        if self.equal_prefill_chunks:
            # Invariant 6: trim ragged chunk ends to the shortest whole chunk. A chunk the
            # budget cut short does not count as whole (trimming the others to it would stall
            # them), but is trimmed like the rest.
            scheduled = [size for size in sizes if size > 0]
            whole = scheduled[:-1] if truncated else scheduled
            if len(scheduled) > 1 and whole:
                shortest = min(whole)
                sizes = [min(size, shortest) for size in sizes]
        return sizes

    def on_chunk_computed(self, chunk: ScheduledChunk) -> Sequence:
        """Advances the sequence's counter after the forward pass; returns the sequence."""
        slot = self.slots.slots[chunk.slot]
        seq = _sequence(slot)
        seq.num_computed_tokens += len(chunk.token_ids)
        if slot.state is SlotState.PREFILLING:
            slot.chunks_done += 1
            if seq.num_computed_tokens == seq.num_tokens:
                self._prefill_order.remove(slot)
                slot.move_to(SlotState.GENERATING)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Marks a placed sequence's slot DRAINING (its KV is freed by ``release_drained``)."""
        assert seq.slot is not None
        slot = self.slots.slots[seq.slot]
        if slot in self._prefill_order:
            self._prefill_order.remove(slot)
        self.slots.drain(slot)

    def drained_slots(self) -> list[Slot]:
        return self.slots.in_state(SlotState.DRAINING)

    def release(self, slot: Slot) -> None:
        if slot.sequence is not None:
            slot.sequence.slot = None
        self.slots.release(slot)

    def remove_waiting(self, request: Request) -> bool:
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.state is not SlotState.FREE for s in self.slots.slots)


def _sequence(slot: Slot) -> Sequence:
    assert slot.sequence is not None, f"slot {slot.index} holds no sequence"
    return slot.sequence
