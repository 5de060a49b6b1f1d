"""The engine's structured-output bookkeeping on the fake runner: masks go with the chunks of
constrained sequences only, the grammar ends the sequence, drafts skip constrained sequences,
and bad constraints fail at validation."""

from __future__ import annotations

import json
import re

import pytest

from slotserve.engine.config import SpeculativeConfig
from slotserve.engine.decoding.structured_output import (
    allowed_mask,
    check_structured_output,
    grammar_of,
)
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import StructuredOutput
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import EOS, FakeRunner

ALPHABET = "abcdefghijklmnopqrstuvwxyz" * 3


def test_the_grammar_shapes_and_ends_the_output() -> None:
    core, runner = make_core(FakeRunner(num_slots=3))
    regex = StructuredOutput("regex", "[a-c]{2}z[0-9]")
    submit(core, "constrained", ALPHABET, max_tokens=30, temperature=0.0, structured_output=regex)
    submit(core, "free", ALPHABET, max_tokens=6, temperature=0.0)
    outputs = run_to_completion(core)
    text = text_of(outputs["constrained"])
    assert re.fullmatch("[a-c]{2}z[0-9]", text)
    finals = [d for o in outputs["constrained"] for d in o.deltas if d.finish_reason]
    assert finals[-1].finish_reason == "stop" and finals[-1].token_ids[-1] != EOS
    # The unconstrained neighbour ran as the fake model says, its chunks never masked.
    free_slot = next(c.slot for b in runner.batches for c in b if c.allowed_tokens is None)
    assert all(c.allowed_tokens is None for b in runner.batches for c in b if c.slot == free_slot)
    assert len(text_of(outputs["free"])) == 6


def test_every_choice_gets_its_own_matcher() -> None:
    core, _ = make_core(FakeRunner(num_slots=4))
    choice = StructuredOutput("choice", json.dumps(["abc", "xyz"]))
    request = submit(
        core, "r", ALPHABET, max_tokens=10, temperature=0.0, n=3, structured_output=choice
    )
    run_to_completion(core)
    matchers = {id(seq.grammar) for seq in request.sequences}
    assert len(matchers) == 3
    assert all(seq.finish_reason == "stop" for seq in request.sequences)


def test_constrained_sequences_are_never_drafted() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    core, runner = make_core(FakeRunner(num_slots=2), speculative=config)
    regex = StructuredOutput("regex", "[a-z]{12}")
    submit(core, "c", ALPHABET, max_tokens=20, temperature=0.0, structured_output=regex)
    run_to_completion(core)
    assert all(c.num_drafts == 0 for b in runner.batches for c in b)


def test_allowed_mask_unpacks_llguidance_bits() -> None:
    import numpy as np

    words = np.zeros(2, dtype=np.int32)
    words[0] = 1 << 3
    words[1] = np.int32(-(2**31))  # bit 31 of word 1: token 63
    mask = allowed_mask(words, 64)
    assert list(np.flatnonzero(mask)) == [3, 63]


@pytest.mark.parametrize(
    ("spec", "phrase"),
    [
        (StructuredOutput("regex", "a(b", "regex"), "unclosed group"),
        (StructuredOutput("json_schema", "{not json"), "not JSON"),
        (StructuredOutput("json_schema", '{"type": "nope"}'), "nope"),
        (StructuredOutput("grammar", 'root ::= "a" missing', "ebnf"), "missing"),
        (StructuredOutput("choice", "[]", "structured_outputs"), "choice"),
        (StructuredOutput("lark", "  "), "empty"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(spec: StructuredOutput, phrase: str) -> None:
    with pytest.raises(InvalidRequestError, match=phrase) as err:
        check_structured_output(spec)
    assert err.value.param == spec.param


def test_objects_with_listed_properties_are_closed() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    grammar = grammar_of(StructuredOutput("json_schema", json.dumps(schema)))
    assert grammar.count('"additionalProperties": false') == 2
    open_schema = {**schema, "additionalProperties": True}
    grammar = grammar_of(StructuredOutput("json_schema", json.dumps(open_schema)))
    assert grammar.count('"additionalProperties": false') == 1
