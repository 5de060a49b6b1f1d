"""Plain objects that cross the engine's boundaries: runner results and request outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


# What requests still in a stopped engine are told (an unload may say more).
STOPPED_REASON = "the engine was stopped (shutdown or reload)"


class FailureKind(enum.Enum):
    """Why the engine ended a request early; the server maps each to one HTTP status."""

    MODEL_UNHEALTHY = "model_unhealthy"  # the runner or the engine loop broke: reload needed
    ENGINE_STOPPED = "engine_stopped"  # the engine was shut down or replaced (reload)
    REQUEST_FAILED = "request_failed"  # this request alone could not run (sampler setup)
    TIMED_OUT = "timed_out"  # past --request-timeout


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
    # Prompt log-probabilities (``SamplingParams.prompt_logprobs``), in the first delta of
    # choice 0: one per prompt token after the first, in order.
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(slots=True)
class RequestOutput:
    """Everything a request produced in one step; ``finished`` once all its sequences ended.

    ``failure`` says why the engine ended the request early, with the words in ``error`` (None
    for a time-out, which ends it like an abort). Times are ``time.monotonic()`` values: when
    the request arrived, and when this output was made; ``queue_seconds`` is set once the
    request left the queue.
    """

    request_id: str
    deltas: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the first choice, as OpenAI's usage reports it
    num_output_tokens: int = 0
    error: str | None = None
    failure: FailureKind | None = None
    arrival_time: float = 0.0
    time: float = 0.0
    queue_seconds: float | None = None
    # An embedding request's vector (``SamplingParams.embed``), in its final output: the
    # pooled hidden state of the prompt, L2-normalised.
    embedding: list[float] | None = None

    @property
    def timed_out(self) -> bool:
        return self.failure is FailureKind.TIMED_OUT
