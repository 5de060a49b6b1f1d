"""What each GENERATING slot puts into the batch, and what a verification of its drafts leaves:
invariant 1 of the scheduler (``scheduler.py`` lists them all).

1. Every GENERATING slot contributes exactly one decode token, every step; with speculative
   decoding (``decoding/speculative.py``) it may be followed by draft tokens, taken from the
   budget before any prefill and never past the sequence's length limit.

Drafts never take the room prefill needs to progress (invariant 5, ``chunking.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.core.slots import Slot, SlotPool
from slotserve.engine.decoding.speculative import Speculator
from slotserve.engine.request import Request, Sequence
from slotserve.engine.runner_interface import KvAllocator, ScheduledChunk


class DecodeChunks:
    """Decode tokens and the speculator's drafts (engine thread only)."""

    def __init__(
        self, policy: ChunkPolicy, kv: KvAllocator, slots: SlotPool, speculator: Speculator | None
    ) -> None:
        self.policy, self.kv, self.slots, self.speculator = policy, kv, slots, speculator

    def drafts(
        self, generating: list[Slot], budget: int, waiting: Iterable[Request]
    ) -> dict[int, list[int]]:
        """The drafts each GENERATING slot verifies this step, by slot (none without a
        speculator), within what ``budget`` leaves beside the decode tokens and prefill."""
        if self.speculator is None:
            return {}
        # Drafts never take the room prefill needs to progress (invariant 5).
        room = budget - len(generating) - self.policy.min_batch_tokens(0)
        in_flight = len(self.slots.running()) + sum(len(r.sequences) for r in waiting)
        return self.speculator.plan([s.held_sequence() for s in generating], room, in_flight)

    def chunk(self, slot: Slot, draft: list[int]) -> ScheduledChunk:
        """The slot's decode token (its last, not yet computed), then ``draft``."""
        seq = slot.held_sequence()
        pos = seq.num_computed_tokens
        return ScheduledChunk(
            slot.index, [seq.token_ids[pos], *draft], pos, True, len(draft),
            adapter=seq.request.submitted.adapter,
        )  # fmt: skip

    def settle(self, seq: Sequence, chunk: ScheduledChunk, accepted: int) -> None:
        """After a verification chunk: the KV of rejected drafts (and of drafts past a stop)
        is dropped, so the slot holds exactly the positions before its last token."""
        assert self.speculator is not None
        self.speculator.verified(seq, chunk.num_drafts, accepted)
        computed = min(chunk.start_pos + 1 + accepted, seq.num_tokens - 1)
        if computed < seq.num_computed_tokens:
            seq.num_computed_tokens = computed
            self.kv.trim_kv(chunk.slot, computed)
