"""How prompts are cut into chunks and how much cached KV may be reused (scheduler invariants
6 and 8): one rule, supplied by the runner in ``ModelInfo.chunk_policy``.

Why a rule at all. Batch invariance means a token's logits do not depend on what ran
beside it or on what the prefix cache supplied. A runner whose kernels compute a token the same
way in any chunk, one-token decode steps included, needs no rule: :data:`ANY_SIZE` (grain 1),
the PyTorch runner's policy. llama.cpp's CPU kernels do not, for three reasons (as of
llama-cpp-python 0.3.36; docs/design/batch-invariance.md):

1. **Attention path by query count.** ggml's flash attention computes a sequence's queries in
   64-row tiles once a sub-batch holds at least 64 of them, row by row below; each path is exact
   whatever the length, but they differ from each other. Hence the **grain**: every prompt chunk
   is at least ``grain`` tokens long and leaves a whole number of grains after it (the first
   chunk takes the odd part; a prompt shorter than a grain is one chunk), so each prompt token is
   computed on the same path alone, beside others, or after a cache hit. A hit must therefore
   leave whole grains to compute (:meth:`ChunkPolicy.reusable_length`), and output tokens, which
   decode computed one at a time, are never handed out by the cache
   (:meth:`ChunkPolicy.cacheable_length`).
2. **Sub-batch cuts.** With per-sequence KV streams llama.cpp cuts a batch into sub-batches
   taking the same number of tokens from each of a run of sequences; ragged chunk ends (40, 41,
   42 tokens...) cost one weight pass each. Hence **equal chunks**: the chunks of one step are
   trimmed to the shortest whole one (:meth:`ChunkPolicy.equalize`), and the runner calls
   ``llama_decode`` once per chunk length.
3. **Split-KV decoding.** A lone decode query past 256 tokens of context takes a split-KV path
   that rounds differently from batched decoding. That one is the runner's alone to fix (it
   adds a throw-away ballast token of a neighbouring slot, ``LlamaCppRunner._ballast_for``): the
   scheduler never sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPolicy:
    grain: int = 1  # chunks of at least this many tokens compute each token alike
    equal_chunks: bool = False  # the step's prefill chunks should share one length
    # The grain counted from position 0, not from the prompt's end: every chunk but a prompt's
    # last ends on a multiple of the grain, and the last one takes the odd part. A runner
    # whose state at a multiple of the grain is the same for every prompt through it (a
    # recurrent state computed in blocks anchored at position 0) can then hand that state
    # to any prompt sharing the prefix; cached KV is reused up to such a multiple only.
    anchored: bool = False
    # Anchored only: the odd part at a prompt's end is a chunk of its own, never the tail of a
    # longer one, for a runner whose attention computes a short chunk's queries on another
    # path than a long chunk's (reason 1 above).
    odd_part_alone: bool = False
    # A runner that computes a generated token's K and V in another arithmetic than a prompt
    # token's (the PyTorch runner's quantized projections on AMX): the cache keeps prompts
    # only, as with a grain, since a later prompt holding those tokens would compute them as
    # a prompt.
    prompts_only: bool = False

    def __post_init__(self) -> None:
        if self.grain < 1:
            raise ValueError("the prefill grain must be >= 1")

    def max_chunk(self, prefill_chunk: int) -> int:
        """The chunk cap in whole grains (the configured cap, rounded down)."""
        if prefill_chunk < self.grain:
            raise ValueError(f"prefill_chunk must be at least the grain ({self.grain})")
        return prefill_chunk // self.grain * self.grain

    def min_batch_tokens(self, num_slots: int) -> int:
        """The smallest step budget that always lets a prompt progress: every slot's decode
        token, and a prompt's last chunk, which may need up to two grains less one."""
        return num_slots + 2 * self.grain - 1

    def chunk_size(self, rest: int, budget: int, max_chunk: int) -> int:
        """The longest chunk of a prompt with ``rest`` tokens left to compute: at least a grain
        (unless it is the whole of a shorter rest), leaving whole grains after it. It fits
        ``budget``, and ``max_chunk`` too unless that cannot hold the odd part and a grain:
        then it exceeds ``max_chunk`` by less than a grain. 0 when nothing fits."""
        grain = self.grain
        room = min(budget, max_chunk)
        if self.anchored:  # a chunk starts on the grid: whole grains, the odd part last
            whole = min(rest, room) // grain * grain
            if rest <= room and not (self.odd_part_alone and whole and rest % grain):
                return rest
            return whole
        if rest <= room:
            return rest
        odd = rest % grain
        size = odd + (room - odd) // grain * grain if room >= odd else 0
        if size >= grain:
            return size
        size = odd + grain if odd else grain  # past the chunk cap by less than a grain
        return size if size <= budget else 0

    def equalize(self, sizes: Sequence[int], rests: Sequence[int], truncated: bool) -> list[int]:
        """Trims a step's chunk sizes (oldest prompt first) to the shortest whole one when the
        policy asks for equal chunks. A chunk the budget cut short (``truncated``: the last
        one scheduled) does not count as whole — trimming the others to it would stall them —
        but is trimmed like the rest, as far as the grain allows."""
        scheduled = [size for size in sizes if size > 0]
        whole = scheduled[:-1] if truncated else scheduled
        if not self.equal_chunks or len(scheduled) < 2 or not whole:
            return list(sizes)
        shortest = min(whole)
        return [
            (self.chunk_size(rest, shortest, shortest) or size) if size > shortest else size
            for size, rest in zip(sizes, rests, strict=True)
        ]

    def reusable_length(self, matched: int, prompt_length: int) -> int:
        """How many of ``matched`` cached prompt tokens a new sequence takes: never the last
        prompt token (it is computed, for logits); with a grain, the rest is a whole number of
        grains, and a prompt shorter than a grain takes nothing (alone it is one short chunk,
        while cached KV always comes from long ones). A token's K and V depend only on the
        tokens before it, so a hit may end anywhere, not only where the source's chunks did."""
        if self.grain == 1:
            return min(matched, prompt_length - 1)
        if self.anchored:
            return min(matched, prompt_length - 1) // self.grain * self.grain
        if prompt_length < self.grain:
            return 0
        rest = -(-(prompt_length - matched) // self.grain) * self.grain  # rounded up
        return max(0, prompt_length - max(rest, self.grain))

    def cacheable_length(self, num_prompt_tokens: int, num_computed_tokens: int) -> int:
        """How many of a sequence's computed tokens the cache may keep and hand out: all of
        them with grain 1 (the prompt alone where ``prompts_only``); else the prompt if it was
        computed in long chunks (at least a grain long), never the output (decoded one token at
        a time, while a new prompt would compute those positions in long chunks)."""
        if self.grain == 1:
            if self.prompts_only:
                return min(num_computed_tokens, num_prompt_tokens)
            return num_computed_tokens
        if self.anchored:  # a prompt's last, partial grain is computed as no longer one is
            return min(num_computed_tokens, num_prompt_tokens) // self.grain * self.grain
        if num_prompt_tokens < self.grain:
            return 0
        return min(num_computed_tokens, num_prompt_tokens)


ANY_SIZE = ChunkPolicy()
