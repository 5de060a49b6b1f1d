"""Request and sequence state.

A request holds ``n`` sequences (one per OpenAI ``choice``); each sequence occupies one slot.
A sequence never has a "phase": it advances by ``num_computed_tokens`` (tokens whose KV is in
the cache) catching up with ``num_tokens`` (prompt + generated). While the gap is larger than
one token it is prefilling; when the last token is computed the runner samples the next one.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.adapters import cache_keys
from slotserve.engine.config import EngineConfig
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.images import image_cache_keys
from slotserve.engine.outputs import FinishReason, SampledToken
from slotserve.engine.runner_interface import ModelInfo, Tokenizer


@dataclass
class Request:
    """One request as the engine core keeps it: what it brought (``submitted``, never changed),
    its sequences, and the core's bookkeeping of it."""

    submitted: EngineCoreRequest
    deadline: float | None = None  # monotonic time after which the engine ends the request
    sequences: list[Sequence] = field(default_factory=list)
    admitted_time: float | None = None
    overtaken: int = 0  # later requests admitted first (schedule policy lpm)

    @property
    def request_id(self) -> str:
        """The key the core, its outputs and its log lines know the request by."""
        return self.submitted.request_id

    def cache_keys(self, tokens: Sequence_[int] | None = None) -> Sequence_[int]:
        """``tokens`` (the prompt by default: a sequence's start with it) as the prefix cache
        keys them: by adapter, and by image over the images' placeholder runs."""
        submitted = self.submitted
        tokens = submitted.prompt_token_ids if tokens is None else tokens
        adapter = submitted.adapter
        return image_cache_keys(cache_keys(tokens, adapter), submitted.images, adapter)

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
    # Speculative decoding (engine/decoding/speculative.py): this sequence's drafts and acceptances.
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # The estimated chance that the next draft is accepted (None: no evidence yet), and a
    # proposal held back (not verified) whose first token is scored once the sequence
    # produces that position: (position, token).
    draft_acceptance: float | None = None
    shadow_draft: tuple[int, int] | None = None
    # Structured output (engine/decoding/structured_output.py): llguidance's matcher, fed
    # every output token; None when unconstrained.
    grammar: Any = None
    # Prompt log-probabilities computed so far (``SamplingParams.prompt_logprobs``, choice 0),
    # and whether they went out with a delta.
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.index == 0 and self.request.submitted.params.prompt_logprobs is not None

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
    submitted: EngineCoreRequest, config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer
) -> Request:
    """The core's state of a validated request: its deadline (``request_timeout_s`` after it
    arrived, None: none) and one sequence (and detokenizer) per choice. A request that sets no
    ``max_tokens`` gets ``max_tokens_default`` within the room its context has left."""
    timeout_s = config.request_timeout_s
    deadline = None if timeout_s is None else submitted.arrival_time + timeout_s
    request = Request(submitted, deadline)
    prompt = submitted.prompt_token_ids
    room = info.max_seq_len - len(prompt)
    params = submitted.params
    cap = config.max_tokens_default
    max_tokens = params.max_tokens or (min(cap, room) if cap else room)
    for index in range(params.n):
        request.sequences.append(
            Sequence(
                request=request,
                index=index,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(tokenizer.token_bytes, params.stop),
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
            )
        )
    return request
