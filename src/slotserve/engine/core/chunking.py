"""The token budget and how prompts are chunked in it: invariants 2, 5, 6, 8 and 10 of the
scheduler (``scheduler.py`` lists them all).

2. PREFILLING slots then share what is left of ``max_batch_tokens``, oldest admission first,
   each taking at most ``prefill_chunk`` tokens; so running streams wait at most one chunk.
   A chunk that starts where its attention outweighs its projections (position at least
   ``1 / ModelInfo.context_cost``, where the runner states one) is not followed by another
   prefill in its step: that step is long already, and a chunk joining it would delay the
   first token it may bring (an agent's next turn over its cached conversation) and gain
   nothing, as such a step does not get cheaper per token with more of them.
5. ``max_batch_tokens > num_slots`` (validated in ``EngineConfig``), so prefill progresses.
6. When the runner's chunk policy asks for equal chunks, the chunks chosen by invariant 2 are
   trimmed to the shortest whole one (``ChunkPolicy.equalize``; why: ``chunk_policy.py``).
   Oldest-first order is kept, so a long prompt still finishes before the ones behind it.
8. Every prompt chunk is at least a grain of the runner's chunk policy long and leaves a whole
   number of grains to compute after it (``ChunkPolicy.chunk_size``); a prompt shorter than a
   grain is one chunk. So every prompt token is computed the same way whatever runs beside it
   and whatever the cache supplied before it (a hit leaves whole grains to compute).
10. An embedding sequence (``SamplingParams.embed``) is prefill only: its chunks are marked
    ``embed`` and never sample, the one ending its prompt ``embed_last``; it finishes there,
    never GENERATING. It takes a cached prefix only when the model pools the last token
    (mean and first-token pooling need every position's hidden state). On an encoder
    (``ModelInfo.bidirectional``) every prompt runs in one chunk: it waits until the whole of
    it fits the step's budget (requests were checked against ``max_batch_tokens``).
"""

from __future__ import annotations

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.encoder_work import EncoderWork
from slotserve.engine.core.slots import Slot
from slotserve.engine.runner_interface import ScheduledChunk


class PrefillChunking:
    """How many prompt tokens each PREFILLING slot runs in a step, and its chunk."""

    def __init__(
        self,
        config: EngineConfig,
        policy: ChunkPolicy,
        whole_prompts: bool = False,
        context_cost: float = 0.0,
        images: EncoderWork | None = None,
    ) -> None:
        """``whole_prompts``: invariant 10 (an encoder). ``context_cost``: invariant 2;
        ``images``: 11 (``encoder_work.py``)."""
        self.max_chunk = policy.max_chunk(config.prefill_chunk)
        if config.max_batch_tokens < policy.min_batch_tokens(config.num_slots):
            # A prompt's last chunk may need up to two grains less one (invariant 8).
            raise ValueError(
                f"max_batch_tokens ({config.max_batch_tokens}) must leave room for two grains "
                f"({policy.grain} tokens each) of prefill beside {config.num_slots} decode tokens"
            )
        self.policy, self.whole_prompts, self.images = policy, whole_prompts, images
        # Invariant 2: where a chunk's attention outweighs its projections (0: nowhere).
        self._long_context = 1.0 / context_cost if context_cost > 0 else 0.0

    def sizes(self, prefill: list[Slot], budget: int) -> list[int]:
        """Prompt tokens for each PREFILLING slot this step, oldest first (0: none)."""
        sizes: list[int] = []
        rests: list[int] = []
        truncated = False
        for slot in prefill:
            seq = slot.held_sequence()
            rest = seq.num_tokens - seq.num_computed_tokens
            if self.images is not None:  # invariant 11
                rest = self.images.ready(slot.index, seq, rest)
            if self.whole_prompts:  # invariant 10: all of it or nothing
                size = rest if rest <= budget else 0
            else:
                size = self.policy.chunk_size(rest, budget, self.max_chunk)
            truncated = truncated or size < min(rest, self.max_chunk)
            sizes.append(size)
            rests.append(rest)
            budget -= size
            if size and self._long_context and seq.num_computed_tokens >= self._long_context:
                budget = 0  # invariant 2: a chunk over a long context is the step's last
        sizes = self.policy.equalize(sizes, rests, truncated)
        images = self.images
        if images is not None:  # invariant 11: never inside a whole image
            pairs = zip(prefill, sizes, strict=True)
            sizes = [images.chunk_size(slot.index, slot.held_sequence(), n) for slot, n in pairs]
        return sizes

    def chunk(self, slot: Slot, size: int) -> ScheduledChunk:
        """The next ``size`` prompt tokens of ``slot``'s sequence: scored where prompt
        log-probabilities are wanted, marked as invariant 10 says for an embedding."""
        seq = slot.held_sequence()
        start = seq.num_computed_tokens
        end = start + size
        targets: list[int] = []
        if seq.wants_prompt_logprobs:
            targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
        submitted = seq.request.submitted
        embed = submitted.params.embed  # invariant 10
        return ScheduledChunk(
            slot.index,
            seq.token_ids[start:end],
            start,
            end == seq.num_tokens and not embed,
            prompt_logprob_targets=targets,
            embed=embed,
            embed_last=embed and end == seq.num_tokens,
            adapter=submitted.adapter,
        )
