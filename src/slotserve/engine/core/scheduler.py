"""Decides, each step, which tokens of which sequences go into the one forward pass.

Works on ints and lists only: slot indices, token counts and token-id slices.

Batch-construction invariants:

1. Every GENERATING slot contributes exactly one decode token, every step; with speculative
   decoding (``decoding/speculative.py``) it may be followed by draft tokens, taken from the budget
   before any prefill and never past the sequence's length limit.
2. PREFILLING slots then share what is left of ``max_batch_tokens``, oldest admission first,
   each taking at most ``prefill_chunk`` tokens; so running streams wait at most one chunk.
   A chunk that starts where its attention outweighs its projections (position at least
   ``1 / ModelInfo.context_cost``, where the runner states one) is not followed by another
   prefill in its step: that step is long already, and a chunk joining it would delay the
   first token it may bring (an agent's next turn over its cached conversation) and gain
   nothing, as such a step does not get cheaper per token with more of them.
3. A sequence appears at most once per batch, with contiguous positions starting at its
   ``num_computed_tokens``.
4. A request with ``n`` sequences is admitted only when ``n`` slots are free, in the order of
   the schedule policy, never overtaken while it does not fit (so a large request cannot
   starve): ``fcfs``, arrival order; ``lpm`` (SGLang's longest prefix match), the longest
   reusable cached prefix first, arrival order among equals, except that a request overtaken
   by ``num_slots`` later ones goes first. With more than ``LPM_MAX_WAITING`` waiting, lpm
   keeps arrival order (matching every waiting prompt would cost more than it saves);
   ``priority`` (vLLM's), the request's priority first (lower values first), arrival order
   among equals; a request waits at most until its ``--request-timeout`` ends it. The orders
   are worked out in ``admission.py``, with invariant 7's wait.
5. ``max_batch_tokens > num_slots`` (validated in ``EngineConfig``), so prefill progresses.
6. When the runner's chunk policy asks for equal chunks, the chunks chosen by invariant 2 are
   trimmed to the shortest whole one (``ChunkPolicy.equalize``; why: ``chunk_policy.py``).
   Oldest-first order is kept, so a long prompt still finishes before the ones behind it.
7. A sequence starts at the longest reusable cached prefix of its prompt
   (``num_computed_tokens`` = cached tokens, at most the prompt length minus one). A waiting
   request whose prompt shares at least ``prefix_wait_min_tokens`` tokens with a prompt still
   prefilling is passed over until that prefill has computed the shared part (a short common
   preamble, such as a chat template's, is not worth a wait); requests behind it may go
   first. The wait is bounded by that prefill, which runs every step (invariant 2), so a
   burst of requests with one new long system prompt computes it once, not once per request.
8. Every prompt chunk is at least a grain of the runner's chunk policy long and leaves a whole
   number of grains to compute after it (``ChunkPolicy.chunk_size``); a prompt shorter than a
   grain is one chunk. So every prompt token is computed the same way whatever runs beside it
   and whatever the cache supplied before it (a hit leaves whole grains to compute).
9. Before a chunk joins the batch its KV is reserved (``reserve_kv``). When the runner's KV
   pool is exhausted, unused cached prefixes are evicted first (LRU); if that is not enough,
   the youngest running sequence (under the priority policy: of the lowest priority) is
   preempted: its KV is given back (kept as evictable cache when the prefix cache is on), its
   chunk leaves the batch, and it waits in its slot, sampler state and output kept. Preempted
   sequences resume oldest first (highest priority first under the priority policy), before
   any new request is admitted, as soon as their first chunk's KV can be reserved; they
   recompute their tokens (prompt and output so far) from the longest cached prefix. The
   oldest sequence always fits (``max_seq_len`` is at most the pool), so work never stalls.
10. An embedding sequence (``SamplingParams.embed``) is prefill only: its chunks are marked
    ``embed`` and never sample, the one ending its prompt ``embed_last``; it finishes there,
    never GENERATING. It takes a cached prefix only when the model pools the last token
    (mean and first-token pooling need every position's hidden state). On an encoder
    (``ModelInfo.bidirectional``) every prompt runs in one chunk: it waits until the whole of
    it fits the step's budget (requests were checked against ``max_batch_tokens``).
11. A prompt chunk ends before the first image whose encode is not done (``images_ready``);
    the encodes run between steps (``EngineCore``), so none lengthens a step beyond its share.
    Where an image's tokens see the whole image (Gemma 3), no chunk ends inside one
    (``chunk_end``): it ends before the image, or waits until the rest of the image fits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceOf

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.admission import (
    admission_order,
    preemption_rank,
    waits_for_prefill_in_flight,
)
from slotserve.engine.core.slots import Slot, SlotPool, SlotState
from slotserve.engine.decoding.speculative import Speculator
from slotserve.engine.images import ImageInputs
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
        images: ImageInputs | None = None,
    ) -> None:
        """``whole_prompts`` and ``embed_reuses_prefix``: invariant 10 (an encoder; a
        model that pools the last token). ``context_cost``: invariant 2; ``images``: 11."""
        self._max_chunk = policy.max_chunk(config.prefill_chunk)
        if config.max_batch_tokens < policy.min_batch_tokens(config.num_slots):
            # A prompt's last chunk may need up to two grains less one (invariant 8).
            raise ValueError(
                f"max_batch_tokens ({config.max_batch_tokens}) must leave room for two grains "
                f"({policy.grain} tokens each) of prefill beside {config.num_slots} decode tokens"
            )
        self.config, self.kv, self.policy = config, kv, policy
        self.prefix_cache, self.speculator = prefix_cache, speculator
        self.whole_prompts, self.images = whole_prompts, images
        self.embed_reuses_prefix = embed_reuses_prefix
        # Invariant 2: where a chunk's attention outweighs its projections (0: nowhere).
        self._long_context = 1.0 / context_cost if context_cost > 0 else 0.0
        self.slots = SlotPool(config.num_slots)
        self.waiting: deque[Request] = deque()
        self.num_preemptions = 0

    def _by_admission(self, state: SlotState) -> list[Slot]:
        """Slots in ``state``, oldest admission first (prefill order)."""
        return sorted(self.slots.in_state(state), key=lambda slot: slot.admission)

    def admit(self) -> list[Sequence]:
        """Resumes preempted sequences, then moves waiting requests into free slots; returns
        the newly placed sequences (resumed ones are not: their runner state is intact).

        With the prefix cache, each placed sequence's slot already holds its cached prefix
        (``num_computed_tokens`` and ``num_cached_tokens`` say how long it is).
        """
        placed: list[Sequence] = []
        for slot in sorted(self.slots.in_state(SlotState.PREEMPTED), key=self._rank):
            if not self._resume(slot):
                return placed  # memory is short: new requests wait behind the preempted ones
        config = self.config
        ordered = admission_order(  # invariant 4; None: arrival order
            config.schedule_policy, self.waiting, self.prefix_cache, self.policy, config.num_slots
        )
        lpm = ordered is not None and config.schedule_policy == "lpm"
        self.waiting = self.waiting if ordered is None else ordered
        passed_over: list[Request] = []
        admitted: list[Request] = []
        while self.waiting and len(self.waiting[0].sequences) <= self.slots.num_free:
            request = self.waiting.popleft()
            if self._waits_for_prefill_in_flight(request):
                passed_over.append(request)
                continue
            for sequence in request.sequences:
                self._place(sequence)
                placed.append(sequence)
            admitted.append(request)
        self.waiting.extendleft(reversed(passed_over))
        if lpm:
            for request in self.waiting:
                request.overtaken += sum(a.arrival_time > request.arrival_time for a in admitted)
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival_time))
        return placed

    def _resume(self, slot: Slot) -> bool:
        """Puts a preempted sequence back to PREFILLING if its first chunk's KV fits."""
        seq = _sequence(slot)
        cache = self.prefix_cache
        if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = []  # scored again from the start: no cached positions
        seq.num_computed_tokens = cache.attach(
            slot.index,
            seq.cache_keys(),
            cache.match(self._reusable(seq)),
            count=False,
            num_prompt_tokens=seq.num_prompt_tokens,
        )
        first_chunk_end = min(seq.num_tokens, seq.num_computed_tokens + self._max_chunk)
        if not self._make_room(slot.index, first_chunk_end):
            self._give_back_kv(slot)
            return False
        slot.move_to(SlotState.PREFILLING)
        return True

    def _place(self, sequence: Sequence) -> Slot:
        cache = self.prefix_cache
        # Match, choose and attach one sequence at a time: attaching can drop cached content
        # of the chosen slot that an earlier match would have pointed at.
        match = cache.match(self._reusable(sequence))
        free = [slot.index for slot in self.slots.in_state(SlotState.FREE)]
        slot = self.slots.acquire(sequence, cache.choose_slot(match, sequence.num_tokens, free))
        cached = cache.attach(slot.index, sequence.cache_keys(), match)
        sequence.num_computed_tokens = sequence.num_cached_tokens = cached
        return slot

    def _reusable(self, seq: Sequence) -> SequenceOf[int]:
        """What the prefix cache may supply: nothing while prompt log-probabilities are wanted
        and not yet delivered (cached positions have no logits to score), nor to an embedding
        whose pooling reads every position (invariant 10)."""
        if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
            return []
        if seq.request.params.embed and not self.embed_reuses_prefix:
            return []
        return seq.cache_keys()

    def _cacheable_tokens(self, seq: Sequence) -> SequenceOf[int]:
        length = self.policy.cacheable_length(seq.num_prompt_tokens, seq.num_computed_tokens)
        return seq.cache_keys(length)

    def _waits_for_prefill_in_flight(self, request: Request) -> bool:
        """Invariant 7 (``admission.py``)."""
        return waits_for_prefill_in_flight(
            request, self._by_admission(SlotState.PREFILLING), self.prefix_cache, self.policy,
            self.config.prefix_wait_min_tokens, self.embed_reuses_prefix,
        )  # fmt: skip

    def schedule(self) -> list[ScheduledChunk]:
        """Builds the next batch; an empty list means there is nothing to run."""
        chunks: dict[int, ScheduledChunk] = {}  # by slot: a preempted slot's chunk is removed
        budget = self.config.max_batch_tokens
        generating = self.slots.in_state(SlotState.GENERATING)
        drafts: dict[int, list[int]] = {}
        if self.speculator is not None:
            # Drafts never take the room prefill needs to progress (invariant 5).
            room = budget - len(generating) - self.policy.min_batch_tokens(0)
            waiting = sum(len(request.sequences) for request in self.waiting)
            in_flight = len(self._running_slots()) + waiting
            drafts = self.speculator.plan([_sequence(s) for s in generating], room, in_flight)
        for slot in generating:
            if slot.state is not SlotState.GENERATING:
                continue  # preempted to make room for an older sequence
            seq = _sequence(slot)
            pos = seq.num_computed_tokens
            draft = drafts.get(slot.index, [])
            if self._reserve(slot, pos + 1 + len(draft), chunks):
                chunks[slot.index] = ScheduledChunk(
                    slot.index, [seq.token_ids[pos], *draft], pos, True, len(draft),
                    adapter=seq.request.adapter,
                )  # fmt: skip
                budget -= 1 + len(draft)
        prefill = self._by_admission(SlotState.PREFILLING)
        for slot, size in zip(prefill, self._prefill_sizes(prefill, budget), strict=True):
            if size == 0 or slot.state is not SlotState.PREFILLING:
                continue
            seq = _sequence(slot)
            start = seq.num_computed_tokens
            end = start + size
            if self._reserve(slot, end, chunks):
                targets: list[int] = []
                if seq.wants_prompt_logprobs:
                    targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
                embed = seq.request.params.embed  # invariant 10
                chunks[slot.index] = ScheduledChunk(
                    slot.index,
                    seq.token_ids[start:end],
                    start,
                    end == seq.num_tokens and not embed,
                    prompt_logprob_targets=targets,
                    embed=embed,
                    embed_last=embed and end == seq.num_tokens,
                    adapter=seq.request.adapter,
                )
        return list(chunks.values())

    # ---- KV memory (invariant 9) ----------------------------------------------------------

    def _reserve(self, slot: Slot, num_tokens: int, chunks: dict[int, ScheduledChunk]) -> bool:
        """Reserves ``slot``'s KV up to ``num_tokens``, preempting the youngest running
        sequences while the pool is short; False when ``slot`` itself was preempted."""
        while not self._make_room(slot.index, num_tokens):
            victim = max(self._running_slots(), key=self._rank)
            self._preempt(victim)
            chunks.pop(victim.index, None)
            if victim is slot:
                return False
        return True

    def _make_room(self, slot: int, num_tokens: int) -> bool:
        """Reserves KV, evicting unused cached prefixes (LRU) while that helps."""
        while not self.kv.reserve_kv(slot, num_tokens):
            if self.prefix_cache.evict_unused() == 0:
                return False
        return True

    def _rank(self, slot: Slot) -> tuple[int, int]:
        return preemption_rank(slot, self.config.schedule_policy == "priority")

    def _running_slots(self) -> list[Slot]:
        return [
            s for s in self.slots.slots if s.state in (SlotState.PREFILLING, SlotState.GENERATING)
        ]

    def _preempt(self, slot: Slot) -> None:
        self._give_back_kv(slot)
        slot.move_to(SlotState.PREEMPTED)
        self.num_preemptions += 1

    def _give_back_kv(self, slot: Slot) -> None:
        """Frees a running (or just re-attached) slot's KV; with the prefix cache its computed
        tokens stay behind as evictable cache, so a resume may find them again."""
        seq = _sequence(slot)
        self.prefix_cache.release(slot.index, self._cacheable_tokens(seq))
        seq.num_computed_tokens = 0

    def _prefill_sizes(self, prefill: list[Slot], budget: int) -> list[int]:
        """Prompt tokens for each PREFILLING slot this step, oldest first (0: none)."""
        sizes: list[int] = []
        rests: list[int] = []
        truncated = False
        for slot in prefill:
            seq = _sequence(slot)
            rest = seq.num_tokens - seq.num_computed_tokens
            if self.images is not None and seq.request.images:  # invariant 11
                start = seq.num_computed_tokens
                rest = min(rest, self.images.images_ready(slot.index, start) - start)
            if self.whole_prompts:  # invariant 10: all of it or nothing
                size = rest if rest <= budget else 0
            else:
                size = self.policy.chunk_size(rest, budget, self._max_chunk)
            truncated = truncated or size < min(rest, self._max_chunk)
            sizes.append(size)
            rests.append(rest)
            budget -= size
            if size and self._long_context and seq.num_computed_tokens >= self._long_context:
                budget = 0  # invariant 2: a chunk over a long context is the step's last
        sizes = self.policy.equalize(sizes, rests, truncated)
        for i, slot in enumerate(prefill):  # invariant 11: never inside a whole image
            seq = _sequence(slot)
            if sizes[i] and self.images is not None and seq.request.images:
                start = seq.num_computed_tokens
                sizes[i] = self.images.chunk_end(slot.index, start, start + sizes[i]) - start
        return sizes

    def on_chunk_computed(self, chunk: ScheduledChunk) -> Sequence:
        """Advances the sequence's counter after the forward pass; returns the sequence."""
        slot = self.slots.slots[chunk.slot]
        seq = _sequence(slot)
        seq.num_computed_tokens += len(chunk.token_ids)
        if slot.state is SlotState.PREFILLING:
            # Shareable at once by requests queued behind (invariant 7).
            self.prefix_cache.extend(slot.index, self._cacheable_tokens(seq))
            if seq.num_computed_tokens == seq.num_tokens and not seq.request.params.embed:
                slot.move_to(SlotState.GENERATING)
        return seq

    def settle_drafts(self, seq: Sequence, chunk: ScheduledChunk, accepted: int) -> None:
        """After a verification chunk: the KV of rejected drafts (and of drafts past a stop)
        is dropped, so the slot holds exactly the positions before its last token."""
        assert self.speculator is not None
        self.speculator.verified(seq, chunk.num_drafts, accepted)
        computed = min(chunk.start_pos + 1 + accepted, seq.num_tokens - 1)
        if computed < seq.num_computed_tokens:
            seq.num_computed_tokens = computed
            self.kv.trim_kv(chunk.slot, computed)

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
                cache.release(slot.index, self._cacheable_tokens(seq))
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


def _sequence(slot: Slot) -> Sequence:
    assert slot.sequence is not None, f"slot {slot.index} holds no sequence"
    return slot.sequence
