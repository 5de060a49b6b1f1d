"""Which waiting requests the scheduler admits first (``scheduler.py``'s invariants 4 and 7):
the ``lpm`` schedule policy's order, the longest reusable cached prefix first; the
``priority`` policy's, the request's priority first; and the wait of a request for a prefill
in flight that will leave it a longer prefix to share."""

from __future__ import annotations

from collections import deque

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.core.slots import Slot
from slotserve.engine.prefix_cache.base import PrefixCache
from slotserve.engine.prefix_cache.radix_tree import common_prefix_length
from slotserve.engine.request import Request

LPM_MAX_WAITING = 128  # SGLang's bound


def order_by_cached_prefix(
    waiting: deque[Request], cache: PrefixCache, policy: ChunkPolicy, num_slots: int
) -> deque[Request] | None:
    """Invariant 4 under lpm: the waiting queue in admission order; None when it keeps
    arrival order."""
    if not 1 < len(waiting) <= LPM_MAX_WAITING or not cache.enabled:
        return None

    def order(item: tuple[int, Request]) -> tuple[int, int, int]:
        arrival, request = item
        if request.overtaken >= num_slots:
            return (0, 0, arrival)
        prompt = request.cache_keys()
        match = cache.match(prompt).length
        return (1, -policy.reusable_length(match, len(prompt)), arrival)

    return deque(request for _, request in sorted(enumerate(waiting), key=order))


def admission_order(
    schedule_policy: str,
    waiting: deque[Request],
    cache: PrefixCache,
    policy: ChunkPolicy,
    num_slots: int,
) -> deque[Request] | None:
    """Invariant 4: the waiting queue in the schedule policy's admission order; None when it
    keeps arrival order. Under ``priority``, lower priority values first (vLLM's meaning),
    arrival order among equals."""
    if schedule_policy == "lpm":
        return order_by_cached_prefix(waiting, cache, policy, num_slots)
    if schedule_policy == "priority":
        return deque(sorted(waiting, key=lambda r: (r.priority, r.arrival_time)))
    return None


def preemption_rank(slot: Slot, by_priority: bool) -> tuple[int, int]:
    """Invariant 9's order: preempted slots resume lowest rank first, and the victim of a
    short pool is the highest rank: by admission, or under the priority policy by the
    request's priority first (a larger value is a lower priority), then admission."""
    sequence = slot.sequence
    assert sequence is not None, f"slot {slot.index} holds no sequence"
    return (sequence.request.priority if by_priority else 0, slot.admission)


def waits_for_prefill_in_flight(
    request: Request,
    prefilling: list[Slot],
    cache: PrefixCache,
    policy: ChunkPolicy,
    min_tokens: int,
    embed_reuses_prefix: bool = True,
) -> bool:
    """Invariant 7: True when ``request`` should wait for one of the ``prefilling`` slots
    (oldest admission first) to compute what it shares with it, at least ``min_tokens``;
    never when it could take no cached prefix (prompt log-probabilities, an embedding
    pooled over every position)."""
    if not cache.enabled or not prefilling or request.params.prompt_logprobs:
        return False
    if request.params.embed and not embed_reuses_prefix:
        return False
    prompt = request.cache_keys()
    cached = policy.reusable_length(cache.match(prompt).length, len(prompt))
    for slot in prefilling:
        seq = slot.sequence
        assert seq is not None, f"slot {slot.index} holds no sequence"
        # What the running prefill will leave in the cache that this prompt can take.
        will_cache = policy.cacheable_length(seq.num_prompt_tokens, seq.num_prompt_tokens)
        shared = common_prefix_length(prompt, seq.cache_keys(will_cache))
        shared = policy.reusable_length(shared, len(prompt))
        if shared >= min_tokens and shared > cached:
            # A cache that resumes only where it kept a state must keep one there.
            cache.keep_state_at(slot.index, shared, seq.num_computed_tokens)
            return True
    return False
