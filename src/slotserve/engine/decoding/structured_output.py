"""Structured output: the engine keeps one llguidance matcher per constrained sequence
and hands the runner, with each chunk that samples, the bitmask of tokens the grammar allows.

Both runners thus enforce the same grammars the same way: the runner only sets disallowed
logits to ``-inf`` in that sequence's row before its sampler runs, so unconstrained neighbours
are computed exactly as without constraints (batch invariance). llguidance was chosen over
xgrammar (vLLM's default) and llama.cpp's GBNF sampler because it has no dependencies, serves
both runners through one tokenizer adapter, and computes a step's masks in parallel, cheaply
next to a forward pass (benchmarks/grammar_mask_cost.py; figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.request import Sequence
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk, Tokenizer
from slotserve.engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

# llguidance's names for our kinds; "grammar" takes Lark or GBNF (told apart by "::=").
_FORMATS: dict[str, llguidance.GrammarFormat] = {
    "json_object": "json_schema",
    "json_schema": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "lark": "lark",
}


# Keys whose value maps names to schemas, and keys whose value is data, not a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_DATA = frozenset({"const", "enum", "default", "examples"})


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its
    properties and says nothing of others: llama.cpp's converter and xgrammar (vLLM) read
    schemas so, OpenAI's strict mode demands it, and a small model otherwise invents keys."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            closed[key] = closed_objects(value)
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar for ``spec``, validated; ``InvalidRequestError`` naming the
    problem."""
    grammar = _converted(spec)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise InvalidRequestError(f"Invalid {spec.kind}: {problem.strip()}", spec.param)
    return grammar


def _converted(spec: StructuredOutput) -> str:
    """``spec`` in llguidance's grammar format, not yet validated."""
    text = '{"type": "object"}' if spec.kind == "json_object" else spec.spec
    if not text or not text.strip():
        raise InvalidRequestError(f"The {spec.kind} constraint must not be empty.", spec.param)
    if spec.kind == "choice":
        choices = json.loads(text)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("choice must list non-empty strings.", spec.param)
    if spec.kind == "json_schema":
        try:
            text = json.dumps(closed_objects(json.loads(text)))
        except ValueError as exc:
            raise InvalidRequestError(f"The JSON schema is not JSON: {exc}", spec.param) from exc
    try:
        return llguidance.grammar_from(_FORMATS[spec.kind], text)
    except Exception as exc:  # the converters raise ValueError and their own parse errors
        raise InvalidRequestError(f"Invalid {spec.kind}: {exc}", spec.param) from exc


def check_structured_output(spec: StructuredOutput) -> None:
    """Raises ``InvalidRequestError`` unless ``spec`` compiles. Any thread, any process."""
    grammar_of(spec)


def _llg_tokenizer(tokenizer: Tokenizer, info: ModelInfo) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary, built from the engine's ``Tokenizer`` so
    that one adapter serves every runner. Control tokens (no output bytes) keep their markup
    behind llguidance's 0xFF marker, so a grammar can never spell them with ordinary text."""
    tokens: list[bytes] = []
    special: list[int] = []
    for token_id in range(info.vocab_size):
        piece = tokenizer.token_bytes(token_id)
        if not piece and (markup := tokenizer.token_text(token_id)):
            piece = b"\xff" + markup.encode("utf-8")
            special.append(token_id)
        tokens.append(piece)
    eog = sorted(info.eog_token_ids)

    class _Vocabulary:
        eos_token_id = eog[0] if eog else 0
        bos_token_id = None
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=info.vocab_size, eos_token=eog
    )


class GrammarMasks:
    """The engine's matchers and masks: the llguidance vocabulary (a fraction of a second)
    and the executor's threads are made on first use, so a server that never sees a
    constraint never pays for them."""

    def __init__(self, tokenizer: Tokenizer, info: ModelInfo) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self._llg: tuple[llguidance.LLTokenizer, llguidance.LLExecutor] | None = None

    def matcher(self, spec: StructuredOutput) -> Any:
        """A new matcher at the start of ``spec``'s grammar, which the request's validation
        (``check_structured_output``) already passed; ``InvalidRequestError`` if the model's
        vocabulary still makes it fail."""
        if self._llg is None:
            self._llg = (_llg_tokenizer(self._tokenizer, self._info), llguidance.LLExecutor())
        matcher = llguidance.LLMatcher(self._llg[0], _converted(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"Invalid {spec.kind}: {matcher.get_error()}", spec.param)
        return matcher

    def attach(
        self, chunks: list[ScheduledChunk], sequence_in: Callable[[int], Sequence | None]
    ) -> list[ScheduledChunk]:
        """``chunks`` with the allowed-token mask set on each one that samples for a
        constrained sequence (``sequence_in(slot)``); the same list when there is none."""
        rows = [
            (i, seq.grammar)
            for i, chunk in enumerate(chunks)
            if chunk.sample and (seq := sequence_in(chunk.slot)) and seq.grammar is not None
        ]
        if not rows:
            return chunks
        assert self._llg is not None  # a matcher exists, so they were made
        masks = llg_numpy.allocate_token_bitmask(len(rows), self._info.vocab_size)
        llg_numpy.fill_next_token_bitmask_par(
            self._llg[1], [(m, row) for row, (_, m) in enumerate(rows)], masks
        )
        attached = list(chunks)
        for row, (i, _) in enumerate(rows):
            assert not attached[i].num_drafts, "constrained sequences are never drafted"
            attached[i] = replace(attached[i], allowed_tokens=masks[row])
        return attached


def advance_grammar(seq: Sequence, token_id: int) -> bool:
    """Feeds a sampled token to ``seq``'s matcher; True when the grammar is complete (nothing
    but the end may follow) or can go no further, so the sequence should stop."""
    matcher = seq.grammar
    if not matcher.consume_token(token_id):
        logger.warning(
            "request %s: the grammar refused token %d (%s); stopping the sequence",
            seq.request.request_id,
            token_id,
            matcher.get_error(),
            extra={"request_id": seq.request.request_id},
        )
        return True
    return bool(matcher.is_stopped())


def allowed_mask(bitmask: np.ndarray[Any, Any], vocab_size: int) -> np.ndarray[Any, Any]:
    """A bool array over the vocabulary from llguidance's packed int32 bitmask."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
