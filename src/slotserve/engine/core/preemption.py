"""KV memory as the scheduler spends it: invariant 9 of the scheduler (``scheduler.py`` lists
them all).

9. Before a chunk joins the batch its KV is reserved (``reserve_kv``). When the runner's KV
   pool is exhausted, unused cached prefixes are evicted first (LRU); if that is not enough,
   the youngest running sequence (under the priority policy: of the lowest priority) is
   preempted: its KV is given back (kept as evictable cache when the prefix cache is on), its
   chunk leaves the batch, and it waits in its slot, sampler state and output kept. Preempted
   sequences resume oldest first (highest priority first under the priority policy), before
   any new request is admitted, as soon as their first chunk's KV can be reserved; they
   recompute their tokens (prompt and output so far) from the longest cached prefix. The
   oldest sequence always fits (``max_seq_len`` is at most the pool), so work never stalls.
"""

from __future__ import annotations

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.prefix_use import PrefixUse
from slotserve.engine.core.slots import Slot, SlotPool, SlotState
from slotserve.engine.prefix_cache.base import Arrival
from slotserve.engine.runner_interface import KvAllocator, ScheduledChunk


def preemption_rank(slot: Slot, by_priority: bool) -> tuple[int, int]:
    """Invariant 9's order: preempted slots resume lowest rank first, and the victim of a
    short pool is the highest rank: by admission, or under the priority policy by the
    request's priority first (a larger value is a lower priority), then admission."""
    priority = slot.held_sequence().request.submitted.priority
    return (priority if by_priority else 0, slot.admission)


class KvMemory:
    """Reserves the KV of the step's chunks, evicting and preempting while the pool is short,
    and resumes preempted sequences (engine thread only)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KvAllocator,
        slots: SlotPool,
        prefix: PrefixUse,
        max_chunk: int,
    ) -> None:
        """``max_chunk``: the most prompt tokens one chunk takes (a resume's first chunk)."""
        self.kv, self.slots, self.prefix = kv, slots, prefix
        self._by_priority = config.schedule_policy == "priority"
        self._max_chunk = max_chunk
        self.num_preemptions = 0

    def resume_preempted(self) -> bool:
        """Puts preempted sequences back to PREFILLING, oldest first; False when one's first
        chunk does not fit (it and those after it wait, and so do new requests)."""
        for slot in sorted(self.slots.in_state(SlotState.PREEMPTED), key=self.rank):
            if not self._resume(slot):
                return False
        return True

    def _resume(self, slot: Slot) -> bool:
        """Puts a preempted sequence back to PREFILLING if its first chunk's KV fits."""
        seq = slot.held_sequence()
        cache = self.prefix.cache
        if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = []  # scored again from the start: no cached positions
        arrival = Arrival(
            seq.cache_keys(),
            cache.match(self.prefix.reusable(seq)),
            resumed=True,
            num_prompt_tokens=seq.num_prompt_tokens,
        )
        seq.num_computed_tokens = cache.attach(slot.index, arrival)
        first_chunk_end = min(seq.num_tokens, seq.num_computed_tokens + self._max_chunk)
        if not self.make_room(slot.index, first_chunk_end):
            self._give_back(slot)
            return False
        slot.move_to(SlotState.PREFILLING)
        return True

    def reserve(self, slot: Slot, num_tokens: int, chunks: dict[int, ScheduledChunk]) -> bool:
        """Reserves ``slot``'s KV up to ``num_tokens``, preempting the youngest running
        sequences while the pool is short (their chunks leave ``chunks``); False when
        ``slot`` itself was preempted."""
        while not self.make_room(slot.index, num_tokens):
            victim = max(self.slots.running(), key=self.rank)
            self._preempt(victim)
            chunks.pop(victim.index, None)
            if victim is slot:
                return False
        return True

    def make_room(self, slot: int, num_tokens: int) -> bool:
        """Reserves KV, evicting unused cached prefixes (LRU) while that helps."""
        while not self.kv.reserve_kv(slot, num_tokens):
            if self.prefix.cache.evict_unused() == 0:
                return False
        return True

    def rank(self, slot: Slot) -> tuple[int, int]:
        return preemption_rank(slot, self._by_priority)

    def _preempt(self, slot: Slot) -> None:
        self._give_back(slot)
        slot.move_to(SlotState.PREEMPTED)
        self.num_preemptions += 1

    def _give_back(self, slot: Slot) -> None:
        """Frees a running (or just re-attached) slot's KV; with the prefix cache its computed
        tokens stay behind as evictable cache, so a resume may find them again."""
        seq = slot.held_sequence()
        self.prefix.cache.release(slot.index, self.prefix.cacheable(seq))
        seq.num_computed_tokens = 0
