"""Which waiting requests go into free slots, and in which order: invariants 4 and 7 of the
scheduler (``scheduler.py`` lists them all).

4. A request with ``n`` sequences is admitted only when ``n`` slots are free, in the order of
   the schedule policy, never overtaken while it does not fit (so a large request cannot
   starve): ``fcfs``, arrival order; ``lpm`` (SGLang's longest prefix match), the longest
   reusable cached prefix first, arrival order among equals, except that a request overtaken
   by ``num_slots`` later ones goes first. With more than ``LPM_MAX_WAITING`` waiting, lpm
   keeps arrival order (matching every waiting prompt would cost more than it saves);
   ``priority`` (vLLM's), the request's priority first (lower values first), arrival order
   among equals; a request waits at most until its ``--request-timeout`` ends it.
7. A sequence starts at the longest reusable cached prefix of its prompt
   (``num_computed_tokens`` = cached tokens, at most the prompt length minus one). A waiting
   request whose prompt shares at least ``prefix_wait_min_tokens`` tokens with a prompt still
   prefilling is passed over until that prefill has computed the shared part (a short common
   preamble, such as a chat template's, is not worth a wait); requests behind it may go
   first. The wait is bounded by that prefill, which runs every step (invariant 2), so a
   burst of requests with one new long system prompt computes it once, not once per request.

Preempted sequences resume before any new request is admitted (invariant 9,
``preemption.py``).
"""

from __future__ import annotations

from collections import deque

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.prefix_use import PrefixUse
from slotserve.engine.core.slots import Slot, SlotPool, SlotState
from slotserve.engine.prefix_cache.base import Arrival, PrefixCache
from slotserve.engine.prefix_cache.tree_node import common_prefix_length
from slotserve.engine.request import Request, Sequence

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
        return deque(sorted(waiting, key=_priority_then_arrival))
    return None


def _priority_then_arrival(request: Request) -> tuple[int, float]:
    return request.submitted.priority, request.submitted.arrival_time


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
    params = request.submitted.params
    if not cache.enabled or not prefilling or params.prompt_logprobs:
        return False
    if params.embed and not embed_reuses_prefix:
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


class Admission:
    """Places waiting requests into free slots (engine thread only)."""

    def __init__(self, config: EngineConfig, slots: SlotPool, prefix: PrefixUse) -> None:
        self.config, self.slots, self.prefix = config, slots, prefix

    def admit(self, waiting: deque[Request]) -> tuple[list[Sequence], deque[Request]]:
        """Moves waiting requests into free slots (invariants 4 and 7); returns the placed
        sequences and the requests still waiting.

        With the prefix cache, each placed sequence's slot already holds its cached prefix
        (``num_computed_tokens`` and ``num_cached_tokens`` say how long it is).
        """
        config, prefix = self.config, self.prefix
        ordered = admission_order(  # invariant 4; None: arrival order
            config.schedule_policy, waiting, prefix.cache, prefix.policy, config.num_slots
        )
        lpm = ordered is not None and config.schedule_policy == "lpm"
        waiting = waiting if ordered is None else ordered
        placed: list[Sequence] = []
        passed_over: list[Request] = []
        admitted: list[Request] = []
        while waiting and len(waiting[0].sequences) <= self.slots.num_free:
            request = waiting.popleft()
            if self._waits_for_prefill_in_flight(request):
                passed_over.append(request)
                continue
            for sequence in request.sequences:
                self._place(sequence)
                placed.append(sequence)
            admitted.append(request)
        waiting.extendleft(reversed(passed_over))
        if lpm:
            for request in waiting:
                arrived = request.submitted.arrival_time
                request.overtaken += sum(a.submitted.arrival_time > arrived for a in admitted)
            waiting = deque(sorted(waiting, key=lambda r: r.submitted.arrival_time))
        return placed, waiting

    def _place(self, sequence: Sequence) -> Slot:
        cache = self.prefix.cache
        # Match, choose and attach one sequence at a time: attaching can drop cached content
        # of the chosen slot that an earlier match would have pointed at.
        match = cache.match(self.prefix.reusable(sequence))
        free = [slot.index for slot in self.slots.in_state(SlotState.FREE)]
        slot = self.slots.acquire(sequence, cache.choose_slot(match, sequence.num_tokens, free))
        cached = cache.attach(slot.index, Arrival(sequence.cache_keys(), match))
        sequence.num_computed_tokens = sequence.num_cached_tokens = cached
        return slot

    def _waits_for_prefill_in_flight(self, request: Request) -> bool:
        """Invariant 7."""
        prefix = self.prefix
        return waits_for_prefill_in_flight(
            request, self.slots.by_admission(SlotState.PREFILLING), prefix.cache, prefix.policy,
            self.config.prefix_wait_min_tokens, prefix.embed_reuses_prefix,
        )  # fmt: skip
