"""Request and sequence state.

A request holds ``n`` sequences (one per OpenAI ``choice``); each sequence occupies one slot.
A sequence never has a "phase": it advances by ``num_computed_tokens`` (tokens whose KV is in
the cache) catching up with ``num_tokens`` (prompt + generated). While the gap is larger than
one token it is prefilling; when the last token is computed the runner samples the next one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.adapters import cache_keys
from slotserve.engine.config import EngineConfig
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.images import ImageInput, image_cache_keys
from slotserve.engine.outputs import FinishReason, SampledToken
from slotserve.engine.runner_interface import ModelInfo, Tokenizer
from slotserve.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One API call as the engine sees it; immutable after submission but for its sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    admitted_time: float | None = None
    deadline: float | None = None  # monotonic time after which the engine ends the request
    overtaken: int = 0  # later requests admitted first (schedule policy lpm)
    priority: int = 0  # schedule policy priority: lower runs first (vLLM's meaning)
    adapter: int = 0  # the LoRA adapter's id (``engine/adapters.py``); 0: the base model
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order (``engine/images.py``)

    def cache_keys(self, tokens: Sequence_[int] | None = None) -> Sequence_[int]:
        """``tokens`` (the prompt by default: a sequence's start with it) as the prefix cache
        keys them: by adapter, and by image over the images' placeholder runs."""
        tokens = self.prompt_token_ids if tokens is None else tokens
        return image_cache_keys(cache_keys(tokens, self.adapter), self.images, self.adapter)

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finish_reason is not None for s in self.sequences)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.output_token_ids) for s in self.sequences)


@dataclass(eq=False)
class Sequence:
    """One generated continuation of a request's prompt."""

    request: Request
    index: int
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # prompt followed by output
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    slot: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Since the last emitted delta; the step loop drains these into a SequenceDelta.
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[SampledToken] = field(default_factory=list)
    # Speculative decoding (engine/speculative.py): this sequence's drafts and acceptances.
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # The estimated chance that the next draft is accepted (None: no evidence yet), and a
    # proposal held back (not verified) whose first token is scored once the sequence
    # produces that position: (position, token).
    draft_acceptance: float | None = None
    shadow_draft: tuple[int, int] | None = None
    # Structured output (engine/structured_output.py): llguidance's matcher, fed every output
    # token; None when unconstrained.
    grammar: Any = None
    # Prompt log-probabilities computed so far (``SamplingParams.prompt_logprobs``, choice 0),
    # and whether they went out with a delta.
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.index == 0 and self.request.params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def cache_keys(self, length: int | None = None) -> Sequence_[int]:
        """The first ``length`` tokens (all by default) as the prefix cache keys them."""
        return self.request.cache_keys(self.token_ids[:length])


def new_request(
    config: EngineConfig,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    priority: int = 0,
    adapter: int = 0,
    images: Sequence_[ImageInput] = (),
) -> Request:
    """A request arriving now, its deadline set, its sequences not yet built."""
    request = Request(
        request_id,
        list(prompt_token_ids),
        params,
        priority=priority,
        adapter=adapter,
        images=tuple(images),
    )
    if config.request_timeout_s is not None:
        request.deadline = request.arrival_time + config.request_timeout_s
    return request


def add_sequences(request: Request, info: ModelInfo, tokenizer: Tokenizer) -> Request:
    """Gives a validated request one sequence (and detokenizer) per choice."""
    prompt = request.prompt_token_ids
    room = info.max_seq_len - len(prompt)
    params = request.params
    for index in range(params.n):
        request.sequences.append(
            Sequence(
                request=request,
                index=index,
                max_tokens=params.max_tokens or room,
                detokenizer=IncrementalDetokenizer(tokenizer.token_bytes, params.stop),
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
            )
        )
    return request
