"""Per-request sampling parameters, validated once at construction.

Each range-bound field is declared here with its range and doc (``engine/sampling_fields.py``):
the request models of every API, the defaults' checks and ``docs/sampling.md`` are derived from
these declarations."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_fields import sampling_field, sampling_fields

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
    """How to pick each next token and when to stop; each range-bound field says what it
    does in its declaration.

    ``embed=True`` makes the request an embedding instead of a generation: the prompt is
    computed like any other (batched with generation, taking prefix-cache hits where the
    model's pooling allows) and pooled into one vector, with no token sampled; the sampling
    fields are then unused.
    """

    max_tokens: int | None = sampling_field(
        None,
        ge=1,
        doc="tokens to generate at most (none: the server's --max-tokens-default, within the "
        "room the context has)",
    )
    temperature: float = sampling_field(
        1.0,
        ge=0.0,
        le=2.0,
        option="temperature",
        doc="divides the logits: 0 picks the likeliest token (greedy), higher flattens",
    )
    top_k: int = sampling_field(
        0,
        ge=-1,
        lt=2**31,
        option="top_k",
        message="must be -1, 0 (disabled) or a positive integer",
        doc="sample among the k likeliest tokens only (0 or -1: all)",
    )
    top_p: float = sampling_field(
        1.0,
        gt=0.0,
        le=1.0,
        option="top_p",
        doc="sample among the likeliest tokens whose probabilities add up to p (1: all)",
    )
    min_p: float = sampling_field(
        0.0,
        ge=0.0,
        le=1.0,
        option="min_p",
        message="must be in [0, 1]",
        doc="drop the tokens less likely than min_p times the likeliest (0: off)",
    )
    repetition_penalty: float = sampling_field(
        1.0,
        gt=0.0,
        le=2.0,
        option="repeat_penalty",
        doc="divides the positive logits of tokens in the prompt or output, multiplies the "
        "negative ones (1: off)",
    )
    presence_penalty: float = sampling_field(
        0.0,
        ge=-2.0,
        le=2.0,
        doc="subtracted from the logit of each token the output holds already (0: off)",
    )
    frequency_penalty: float = sampling_field(
        0.0,
        ge=-2.0,
        le=2.0,
        doc="subtracted from a token's logit once per time the output holds it (0: off)",
    )
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = sampling_field(
        None,
        ge=-(2**63),
        lt=2**64,
        message="out of range",
        doc="seeds this request's draws: the same seed, the same text (none: a fresh seed)",
    )
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = sampling_field(1, ge=1, le=MAX_N, doc="completions generated from the prompt")
    logprobs: int | None = sampling_field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        doc="log-probabilities of the sampled tokens, with the top k alternatives "
        "(none: off; 0: the sampled token's only)",
    )
    structured_output: StructuredOutput | None = None
    # Not computed unless asked: cached positions have no logits, so the prefix cache is then
    # not used.
    prompt_logprobs: int | None = sampling_field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        doc="log-probabilities of the prompt's tokens, each given the ones before it, with the "
        "top k alternatives (none: off; such a request takes no prefix-cache hit)",
    )
    embed: bool = False

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            declared = SAMPLING_FIELDS.get(name)
            if declared is not None and value is not None:
                _check(declared.accepts(value), name, declared.error)
            elif name in _ELEMENT_CHECKS:
                _ELEMENT_CHECKS[name](value)
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


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"'{param}' {message}.", param=param)


def _check_logit_bias(pairs: tuple[tuple[int, float], ...]) -> None:
    for token_id, bias in pairs:
        _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
        _check(
            math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"bias for token {token_id} must be between -100 and 100",
        )


def _check_stop(stop: tuple[str, ...]) -> None:
    _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
    _check(all(stop), "stop", "stop strings must not be empty")


def _check_stop_token_ids(token_ids: tuple[int, ...]) -> None:
    _check(all(t >= 0 for t in token_ids), "stop_token_ids", "must be >= 0")


# The declared fields by name: what the request models, the defaults' checks and the docs read.
SAMPLING_FIELDS = sampling_fields(SamplingParams)
# The fields whose rule is on each element rather than a range; checked in field order with
# the ranges, so that a request with several bad fields is told of the first of them.
_ELEMENT_CHECKS: dict[str, Callable[[Any], None]] = {
    "logit_bias": _check_logit_bias,
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
}
