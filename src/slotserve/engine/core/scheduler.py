"""Decides, each step, which tokens of which sequences go into the one forward pass.

Works on ints and lists only: slot indices, token counts and token-id slices. One small part
per concern keeps the batch-construction invariants the code cites by number, each stated in
full beside the code that keeps it:

1. every GENERATING slot decodes one token a step, drafts after it     ``decode_chunks.py``
2. prefill shares the rest of the budget, oldest first, a chunk each   ``chunking.py``
3. a sequence at most once per batch, contiguous                       here, below
4. admission in the schedule policy's order, never overtaking          ``admission.py``
5. prefill always has room beside the decode tokens                    ``chunking.py``
6. equal chunks where the chunk policy asks for them                   ``chunking.py``
7. the longest reusable cached prefix; the wait for a prefill          ``admission.py``
8. chunks of whole grains                                              ``chunking.py``
9. KV reserved first: eviction, then preemption; resumes               ``preemption.py``
10. embeddings: prefill only; an encoder's prompt in one chunk         ``chunking.py``
11. a chunk ends before an image not yet encoded                       ``encoder_work.py``

3. A sequence appears at most once per batch, with contiguous positions starting at its
   ``num_computed_tokens``: :meth:`Scheduler.schedule` keeps one chunk per slot, decode
   chunks first (invariant 1), then prefill chunks in what is left of the budget (2).

The scheduler keeps no derived state: the prefill and resume orders are the PREFILLING and
PREEMPTED slots sorted by admission.
"""

from __future__ import annotations

from collections import deque

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.admission import Admission
from slotserve.engine.core.chunking import PrefillChunking
from slotserve.engine.core.decode_chunks import DecodeChunks
from slotserve.engine.core.encoder_work import EncoderWork
from slotserve.engine.core.preemption import KvMemory
from slotserve.engine.core.prefix_use import PrefixUse
from slotserve.engine.core.slots import Slot, SlotPool, SlotState
from slotserve.engine.decoding.speculative import Speculator
from slotserve.engine.prefix_cache.base import PrefixCache
from slotserve.engine.request import Request, Sequence
from slotserve.engine.runner_interface import KvAllocator, ScheduledChunk

_HOLDS_KV = (SlotState.PREFILLING, SlotState.GENERATING, SlotState.DRAINING)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KvAllocator,
        policy: ChunkPolicy,
        prefix_cache: PrefixCache,
        speculator: Speculator | None = None,
        whole_prompts: bool = False,
        embed_reuses_prefix: bool = True,
        context_cost: float = 0.0,
        images: EncoderWork | None = None,
    ) -> None:
        """``whole_prompts`` and ``embed_reuses_prefix``: invariant 10 (an encoder; a
        model that pools the last token). ``context_cost``: invariant 2; ``images``: 11."""
        self.chunking = PrefillChunking(config, policy, whole_prompts, context_cost, images)
        self.config, self.prefix_cache, self.speculator = config, prefix_cache, speculator
        self.slots = SlotPool(config.num_slots)
        self.waiting: deque[Request] = deque()
        self.prefix = PrefixUse(prefix_cache, policy, embed_reuses_prefix)
        self.admission = Admission(config, self.slots, self.prefix)
        self.memory = KvMemory(config, kv, self.slots, self.prefix, self.chunking.max_chunk)
        self.decode = DecodeChunks(policy, kv, self.slots, speculator)

    def admit(self) -> list[Sequence]:
        """Resumes preempted sequences (invariant 9), then moves waiting requests into free
        slots (invariants 4 and 7); returns the newly placed sequences (resumed ones are not:
        their runner state is intact)."""
        if not self.memory.resume_preempted():
            return []  # memory is short: new requests wait behind the preempted ones
        placed, self.waiting = self.admission.admit(self.waiting)
        return placed

    def schedule(self) -> list[ScheduledChunk]:
        """Builds the next batch; an empty list means there is nothing to run."""
        chunks: dict[int, ScheduledChunk] = {}  # by slot: a preempted slot's chunk is removed
        budget = self.config.max_batch_tokens
        generating = self.slots.in_state(SlotState.GENERATING)
        drafts = self.decode.drafts(generating, budget, self.waiting)
        for slot in generating:
            if slot.state is not SlotState.GENERATING:
                continue  # preempted to make room for an older sequence
            draft = drafts.get(slot.index, [])
            end = slot.held_sequence().num_computed_tokens + 1 + len(draft)
            if self.memory.reserve(slot, end, chunks):
                chunks[slot.index] = self.decode.chunk(slot, draft)
                budget -= 1 + len(draft)
        prefill = self.slots.by_admission(SlotState.PREFILLING)
        for slot, size in zip(prefill, self.chunking.sizes(prefill, budget), strict=True):
            if size == 0 or slot.state is not SlotState.PREFILLING:
                continue
            end = slot.held_sequence().num_computed_tokens + size
            if self.memory.reserve(slot, end, chunks):
                chunks[slot.index] = self.chunking.chunk(slot, size)
        return list(chunks.values())

    def on_chunk_computed(self, chunk: ScheduledChunk) -> Sequence:
        """Advances the sequence's counter after the forward pass; returns the sequence."""
        slot = self.slots.slots[chunk.slot]
        seq = slot.held_sequence()
        seq.num_computed_tokens += len(chunk.token_ids)
        if slot.state is SlotState.PREFILLING:
            # Shareable at once by requests queued behind (invariant 7).
            self.prefix_cache.extend(slot.index, self.prefix.cacheable(seq))
            embed = seq.request.submitted.params.embed  # invariant 10: never GENERATING
            if seq.num_computed_tokens == seq.num_tokens and not embed:
                slot.move_to(SlotState.GENERATING)
        return seq

    def settle_drafts(self, seq: Sequence, chunk: ScheduledChunk, accepted: int) -> None:
        """After a verification chunk: what the runner accepted (``decode_chunks.py``)."""
        self.decode.settle(seq, chunk, accepted)

    @property
    def num_preemptions(self) -> int:
        return self.memory.num_preemptions

    def finish(self, seq: Sequence) -> None:
        """Marks a placed sequence's slot DRAINING (``release`` then frees or caches its KV)."""
        assert seq.slot is not None
        self.slots.drain(self.slots.slots[seq.slot])

    def drained_slots(self) -> list[Slot]:
        return self.slots.in_state(SlotState.DRAINING)

    def release_index(self, index: int) -> None:
        self.release(self.slots.slots[index])

    def release(self, slot: Slot) -> None:
        """Frees a DRAINING slot; with the prefix cache its computed tokens stay cached."""
        seq = slot.sequence
        cache = self.prefix_cache
        # A sequence preempted before it ended has no KV of its own left: nothing to release.
        if seq is not None and cache.is_running(slot.index):
            if seq.finish_reason == "error":
                cache.drop(slot.index)  # its KV may be half written
            else:
                cache.release(slot.index, self.prefix.cacheable(seq))
        if seq is not None:
            seq.slot = None
        self.slots.release(slot)

    def running_kv_tokens(self) -> dict[int, int]:
        """Slots whose KV belongs to a running sequence, and the tokens it must hold (PREEMPTED
        sequences gave theirs back)."""
        return {
            slot.index: slot.sequence.num_computed_tokens
            for slot in self.slots.slots
            if slot.sequence is not None and slot.state in _HOLDS_KV
        }

    def remove_waiting(self, request: Request) -> bool:
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.state is not SlotState.FREE for s in self.slots.slots)
