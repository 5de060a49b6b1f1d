"""The prefix cache as the scheduler uses it: what of a sequence the cache may supply when it
starts or resumes (invariant 7's longest reusable prefix, with invariant 10's exception for
embeddings), and which computed tokens it may keep (``ChunkPolicy.cacheable_length``)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.prefix_cache.base import PrefixCache
from slotserve.engine.request import Sequence


@dataclass(frozen=True)
class PrefixUse:
    cache: PrefixCache
    policy: ChunkPolicy
    # The model pools the last token, so an embedding may take a cached prefix (invariant 10).
    embed_reuses_prefix: bool = True

    def reusable(self, seq: Sequence) -> SequenceOf[int]:
        """What the prefix cache may supply: nothing while prompt log-probabilities are wanted
        and not yet delivered (cached positions have no logits to score), nor to an embedding
        whose pooling reads every position (invariant 10)."""
        if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
            return []
        if seq.request.submitted.params.embed and not self.embed_reuses_prefix:
            return []
        return seq.cache_keys()

    def cacheable(self, seq: Sequence) -> SequenceOf[int]:
        """The computed tokens of ``seq`` the cache may keep and hand out."""
        length = self.policy.cacheable_length(seq.num_prompt_tokens, seq.num_computed_tokens)
        return seq.cache_keys(length)
