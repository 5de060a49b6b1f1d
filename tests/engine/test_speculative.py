"""Speculative decoding in the engine (SPEC E12), on the fake runner: the n-gram proposer, the
configuration, verification chunks in the step, rollback of rejected drafts, stops inside an
accepted run, the switches and the counters. The real runners: tests/runner/test_speculative.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from slotserve.engine.config import SpeculativeConfig
from slotserve.engine.decoding.speculative import (
    NgramProposer,
    SpecCounters,
    best_draft_length,
    build_speculator,
    expected_tokens,
)
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.verify_cost import VerifyCost
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import FakeRunner

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def spec(**overrides: object) -> SpeculativeConfig:
    values: dict[str, object] = {"num_speculative_tokens": 4, "disable_by_batch_size": 8}
    values.update(overrides)
    return SpeculativeConfig(**values)  # type: ignore[arg-type]


# ---- proposer -------------------------------------------------------------------------------


def test_proposer_takes_the_longest_suffix_match_and_its_latest_occurrence() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    # Suffix [1, 2, 3] occurred at 0 (then 9) and at 4 (then 7): the latest wins.
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]
    # Only a 1-token suffix matches: [3] last occurred followed by 4.
    assert proposer.propose([3, 4, 5, 6, 3], 3) == [4, 5, 6]
    # A longer match beats a more recent shorter one.
    assert proposer.propose([7, 8, 1, 9, 8, 2, 8, 7, 8], 1) == [1]


def test_proposer_respects_min_n_and_the_limit() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose([5, 6, 1, 2, 6], 4) == []  # only a 1-token match exists
    assert proposer.propose([1, 2, 3, 4, 1, 2], 1) == [3]
    assert proposer.propose([1, 2, 3, 4, 1, 2], 0) == []
    assert proposer.propose([1, 2], 4) == []  # nothing earlier to match
    # The match runs up to the end: fewer tokens than asked for.
    assert proposer.propose([1, 2, 9, 1, 2], 5) == [9, 1, 2]


# ---- configuration --------------------------------------------------------------------------


def test_config_takes_vllm_keys_and_rejects_the_rest() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    for bad, message in (
        ("[1]", "JSON object"),
        ("{nope", "not valid JSON"),
        ('{"method": "eagle"}', "not supported"),
        ('{"num_speculative_tokens": 2}', 'needs "method"'),
        ('{"method": "ngram", "speculative_tokens": 2}', "unknown keys"),
        ('{"method": "ngram", "num_speculative_tokens": "2"}', "wrong type"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1..16"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(bad)


def test_counters_add_per_position() -> None:
    counters = SpecCounters()
    counters.record(drafted=4, accepted=2)
    counters.record(drafted=2, accepted=2)
    assert counters.accepted_per_position == [2, 2, 0, 0]
    total = counters.plus(SpecCounters(1, 5, 1, [1, 0, 0, 0, 0]))
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 11, 5)
    assert total.accepted_per_position == [3, 2, 0, 0, 0]


# ---- in the engine --------------------------------------------------------------------------


def _generate(
    speculative: SpeculativeConfig | None, jobs: dict[str, dict[str, object]]
) -> dict[str, Any]:
    core, runner = make_core(FakeRunner(num_slots=4), speculative=speculative)
    for rid, job in jobs.items():
        params = dict(job)
        prompt = str(params.pop("prompt"))
        submit(core, rid, prompt, **params)
    outputs: dict[str, list[RequestOutput]] = {}
    while core.has_work:
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        core.check_integrity()  # every step: each slot's KV is exactly what it computed
    results = {}
    for rid, outs in outputs.items():
        deltas = [d for o in outs for d in o.deltas]
        tokens = [t for d in deltas for t in d.token_ids]
        results[rid] = (tokens, text_of(outs), deltas[-1].finish_reason, deltas[-1].stop_reason)
    return {"results": results, "stats": core.snapshot(), "batches": runner.batches}


JOBS: dict[str, dict[str, object]] = {
    "alpha": {"prompt": ALPHABET, "max_tokens": 60, "temperature": 0.0},
    "shifted": {"prompt": ALPHABET[3:], "max_tokens": 45, "temperature": 0.0},
}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_outputs_are_the_same_with_and_without_drafts(k: int) -> None:
    plain = _generate(None, JOBS)
    drafted = _generate(spec(num_speculative_tokens=k), JOBS)
    assert drafted["results"] == plain["results"]
    counters = drafted["stats"].spec_decode
    assert counters.num_accepted_tokens > 0, "no draft was ever accepted: the case never ran"
    assert len(counters.accepted_per_position) == k
    # Accepted drafts took steps away.
    assert len(drafted["batches"]) < len(plain["batches"])
    assert plain["stats"].spec_decode is None


def test_rejected_drafts_are_rolled_back() -> None:
    # The fake model continues the alphabet by position; the prompt's repeated tail makes the
    # proposer guess wrong, so drafts are rejected while KV integrity is checked every step.
    jobs: dict[str, dict[str, object]] = {
        "mixed": {"prompt": "xyzabcxyzabq", "max_tokens": 30, "temperature": 0.0}
    }
    plain = _generate(None, jobs)
    drafted = _generate(spec(min_acceptance_rate=0.0), jobs)
    assert drafted["results"] == plain["results"]
    counters = drafted["stats"].spec_decode
    assert counters.num_draft_tokens > counters.num_accepted_tokens, "no draft was rejected"


@pytest.mark.parametrize(
    "limits",
    [{"stop": ["hij"]}, {"stop_token_ids": [ord("m")]}, {"max_tokens": 13}],
    ids=["stop-string", "stop-token", "max-tokens"],
)
def test_a_stop_inside_an_accepted_run_ends_as_without_drafts(limits: dict[str, object]) -> None:
    job: dict[str, object] = {
        "prompt": ALPHABET * 2,
        "max_tokens": 40,
        "temperature": 0.0,
        **limits,
    }
    plain = _generate(None, {"r": job})
    drafted = _generate(spec(num_speculative_tokens=8), {"r": job})
    assert drafted["results"] == plain["results"]
    assert drafted["results"]["r"][2] in ("stop", "length")
    # The stop fell inside a run of drafts: the step that ended it verified more than it kept.
    assert drafted["stats"].spec_decode.num_accepted_tokens >= 8


def test_no_drafts_above_the_batch_size_limit_or_for_low_acceptance() -> None:
    jobs = {f"r{i}": {"prompt": ALPHABET, "max_tokens": 30, "temperature": 0.0} for i in range(3)}
    over = _generate(spec(disable_by_batch_size=2), jobs)
    assert over["stats"].spec_decode.num_drafts == 0
    assert all(len(c.token_ids) == 1 for batch in over["batches"][1:] for c in batch)
    # Drafts that keep missing stop after the probe.
    bad = {"r": {"prompt": "xyzabcxyzabq" * 3, "max_tokens": 60, "temperature": 0.0}}
    low = _generate(spec(min_acceptance_rate=1.0, probe_tokens=4), bad)
    assert low["stats"].spec_decode.num_draft_tokens <= 4 + 4


def test_waiting_requests_count_as_in_flight() -> None:
    # vLLM's reading of disable_by_batch_size: requests queued behind a full server count.
    core, runner = make_core(FakeRunner(num_slots=1), speculative=spec(disable_by_batch_size=1))
    submit(core, "first", ALPHABET, max_tokens=20, temperature=0.0)
    submit(core, "second", "zy" + ALPHABET, max_tokens=20, temperature=0.0)  # nothing shared
    outputs = run_to_completion(core)
    assert text_of(outputs["first"]) == ALPHABET[:20]
    assert text_of(outputs["second"]) == ALPHABET[2:22]
    chunks = [chunk for batch in runner.batches for chunk in batch]
    second_starts = [i for i, chunk in enumerate(chunks) if chunk.start_pos == 0][1]
    # While the second request waits for the one slot, the first does not draft; the second,
    # alone, does (its prompt holds the alphabet it continues).
    assert not any(chunk.num_drafts for chunk in chunks[:second_starts])
    assert any(chunk.num_drafts for chunk in chunks[second_starts:])


def test_run_to_completion_helper_still_works_with_drafts() -> None:
    core, _ = make_core(FakeRunner(num_slots=2), speculative=spec())
    submit(core, "a", ALPHABET, max_tokens=20, temperature=0.0)
    outputs = run_to_completion(core)
    assert text_of(outputs["a"]) == ALPHABET[:20]


# ---- how many drafts pay ---------------------------------------------------------------------

# The llama.cpp runner's measured cost (benchmarks/verify_cost.py): each draft ~half a step.
COSTLY = VerifyCost(first=0.39, per_draft=0.5)


def test_the_draft_length_is_the_one_with_most_tokens_per_cost() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    cheap = VerifyCost(first=0.0, per_draft=0.025)
    assert best_draft_length(0.9, cheap, 8) == 8  # drafts nearly free: verify all
    assert 3 <= best_draft_length(0.6, cheap, 8) < 8  # ...but not a tail rarely reached
    assert best_draft_length(0.02, cheap, 8) == 0  # ...nor drafts that are never right
    assert best_draft_length(0.6, COSTLY, 8) == 0  # half a step per draft needs more
    assert best_draft_length(0.75, COSTLY, 8) == 0
    assert 3 <= best_draft_length(0.9, COSTLY, 8) < 8
    assert best_draft_length(1.0, COSTLY, 8) == 8
    assert best_draft_length(1.0, COSTLY, 3) == 3  # never past the limit


def test_a_lone_step_that_pays_for_a_token_anyway_gets_a_draft() -> None:
    ballast = replace(COSTLY, lone_step_pays_a_draft_from=255)
    assert ballast.of(0, 300, alone=True) == 1.0
    assert ballast.of(1, 300, alone=True) == pytest.approx(1.0)  # the draft replaces ballast
    assert ballast.of(2, 300, alone=True) == pytest.approx(2.39 / 1.89)
    assert ballast.of(2, 300, alone=False) == COSTLY.of(2) == pytest.approx(2.39)
    assert ballast.of(2, 254, alone=True) == COSTLY.of(2)
    # Even an unlikely draft is worth the place of a token computed for nothing.
    assert best_draft_length(0.3, ballast, 8, context=300, alone=True) >= 1
    assert best_draft_length(0.3, ballast, 8, context=300, alone=False) == 0
    assert best_draft_length(0.3, ballast, 8, context=100, alone=True) == 0


# The reply repeats "pq" with a new letter after it every time: each proposal (after "pq")
# misses, and no other bigram recurs.
MISSING = "".join(f"pq{letter}" for letter in "rstuvwxyzabcdefghijklmno")


def _run_with_cost(
    cost: VerifyCost | None, prompt: str, max_tokens: int, reply: str | None = None
) -> dict[str, Any]:
    replies = {prompt: reply.encode()} if reply else {}
    core, runner = make_core(
        FakeRunner(num_slots=2, verify_cost=cost or VerifyCost(), replies=replies),
        speculative=spec() if cost else None,
    )
    submit(core, "r", prompt, max_tokens=max_tokens, temperature=0.0)
    outputs = run_to_completion(core)
    drafting = [i for i, batch in enumerate(runner.batches) if any(c.num_drafts for c in batch)]
    return {
        "text": text_of(outputs["r"]),
        "stats": core.snapshot(),
        "steps": len(runner.batches),
        "drafting": drafting,
    }


def test_costly_drafts_start_after_the_proposals_prove_right() -> None:
    # The fake model continues the alphabet, which the prompt holds: every proposal is right.
    # At half a step per draft the prior does not justify drafting; the held-back proposals,
    # scored against the tokens produced, do after a few steps.
    costly = _run_with_cost(COSTLY, ALPHABET, 40)
    plain = _run_with_cost(None, ALPHABET, 40)
    assert costly["text"] == plain["text"] == (ALPHABET * 3)[:40]
    assert costly["drafting"], "proposals that are always right never earned drafting"
    assert 2 <= costly["drafting"][0] <= 6, "drafting should start after a few right proposals"
    counters = costly["stats"].spec_decode
    assert counters.num_accepted_tokens == counters.num_draft_tokens  # all were right
    assert costly["steps"] < plain["steps"] - 15


def test_costly_drafts_never_start_or_stop_when_they_miss() -> None:
    plain = _run_with_cost(None, "go", 60, MISSING)
    cheap = _run_with_cost(VerifyCost(), "go", 60, MISSING)
    costly = _run_with_cost(COSTLY, "go", 60, MISSING)
    assert cheap["text"] == costly["text"] == plain["text"] == MISSING[:60]
    assert cheap["stats"].spec_decode.num_draft_tokens > 0  # cheap: worth a try
    assert cheap["stats"].spec_decode.num_accepted_tokens == 0
    assert costly["stats"].spec_decode.num_draft_tokens == 0  # costly: the shadows said no
    # A copy that turns into misses: drafting while copying, none once the misses set in.
    prompt = ALPHABET
    turned = _run_with_cost(COSTLY, prompt, 80, ALPHABET + MISSING)
    assert turned["text"] == (ALPHABET + MISSING)[:80]
    assert turned["drafting"], "the copied part never drafted"
    assert turned["drafting"][-1] < turned["steps"] - 30, "drafting went on into the misses"


def test_the_configured_floor_still_ends_drafting() -> None:
    info = FakeRunner().model_info
    speculator = build_speculator(spec(min_acceptance_rate=0.3), info)
    assert speculator is not None and speculator.verify_cost == info.verify_cost
    assert build_speculator(spec(), replace(info, speculative_unsupported="no")) is None
