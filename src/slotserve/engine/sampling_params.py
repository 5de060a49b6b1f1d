"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from slotserve.engine.errors import InvalidRequestError

# OpenAI's documented bound for logit_bias values; larger values are almost always a client bug.
MAX_LOGIT_BIAS = 100.0
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced with a token mask at every sampling step
    (``engine/decoding/structured_output.py``).

    ``kind``: ``json_object`` (any JSON object), ``json_schema`` (``spec`` holds the schema as
    JSON text), ``regex``, ``choice`` (``spec``: a JSON list of strings), ``grammar`` (Lark or
    llama.cpp's GBNF) or ``lark``. ``param`` is the request field that error messages name.
    """

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar", "lark"]
    spec: str | None = None
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``max_tokens=None`` means "until the sequence's context is full". ``logprobs=None`` turns
    log-probabilities off; ``0`` returns only the sampled token's, ``k`` adds the top ``k``.
    ``top_k <= 0`` disables top-k.

    ``embed=True`` makes the request an embedding instead of a generation: the prompt is
    computed like any other (batched with generation, taking prefix-cache hits where the
    model's pooling allows) and pooled into one vector, with no token sampled; the sampling
    fields are then unused.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # Log-probabilities of the prompt's tokens (each given the ones before it), with the top
    # ``k`` alternatives; None: not computed (the prefix cache is then not used: cached
    # positions have no logits).
    prompt_logprobs: int | None = None
    embed: bool = False

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(
            _finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature",
            "must be between 0 and 2",
        )
        _check(-1 <= self.top_k < 2**31, "top_k", "must be -1, 0 (disabled) or a positive integer")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "must be in (0, 2]",
        )
        _check(
            _finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be between -2 and 2",
        )
        _check(
            _finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be between -2 and 2",
        )
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
            _check(
                _finite(bias) and abs(bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"bias for token {token_id} must be between -100 and 100",
            )
        _check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "out of range")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"
        )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "prompt_logprobs",
            f"must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        if self.embed:
            _check(self.n == 1, "n", "must be 1 for an embedding")
            _check(self.prompt_logprobs is None, "prompt_logprobs", "is not for embeddings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_sampler_chain(self) -> bool:
        """False when the next token is a plain argmax over the logits (a structured-output
        mask, when there is one, is applied to them first)."""
        return not (self.is_greedy and not self.has_penalties and not self.logit_bias)

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        for token_id, _ in self.logit_bias:
            _check(
                token_id < vocab_size,
                "logit_bias",
                f"token id {token_id} is outside the vocabulary (size {vocab_size})",
            )
        for token_id in self.stop_token_ids:
            _check(
                token_id < vocab_size,
                "stop_token_ids",
                f"token id {token_id} is outside the vocabulary (size {vocab_size})",
            )


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"'{param}' {message}.", param=param)
