"""Plain objects that cross the engine's boundaries: runner results and request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One token a runner sampled for a sequence, with log-probabilities when asked for.

    ``logprob`` is the sampled token's log-probability under the model's raw distribution;
    ``top_logprobs`` lists the ``k`` most likely ``(token_id, logprob)`` pairs, best first.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence (one OpenAI ``choice``) produced in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the sequence, when one did.
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestOutput:
    """Everything a request produced in one step; ``finished`` once all its sequences ended.

    ``error`` is set when the request failed (the runner broke); ``timed_out`` when the engine
    ended it at its deadline. Times are ``time.monotonic()`` values: when the request arrived,
    and when this output was made; ``queue_seconds`` is set once the request left the queue.
    """

    request_id: str
    deltas: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the first choice, as OpenAI's usage reports it
    num_output_tokens: int = 0
    error: str | None = None
    timed_out: bool = False
    arrival_time: float = 0.0
    time: float = 0.0
    queue_seconds: float | None = None
