"""Prompt log-probabilities in the engine (fake runner): every prompt token after the first is
scored once, in order, across prefill chunks; the prefix cache supplies nothing to such a
request (cached positions have no logits), and the scores go out with choice 0's first delta."""

from __future__ import annotations

from tests.engine.helpers import make_core, run_to_completion, submit
from tests.fake_runner import FakeRunner

PROMPT = "the quick brown fox jumps over the lazy dog"


def _first_scores(outputs: list) -> list:  # type: ignore[type-arg]
    deltas = [d for o in outputs for d in o.deltas if d.prompt_logprobs is not None]
    assert len(deltas) == 1 and deltas[0].index == 0
    return list(deltas[0].prompt_logprobs)


def test_every_prompt_token_after_the_first_is_scored_once_in_order() -> None:
    core, runner = make_core(FakeRunner(num_slots=2), prefill_chunk=8)
    submit(core, "r", PROMPT, max_tokens=3, temperature=0.0, prompt_logprobs=2, n=2)
    outputs = run_to_completion(core)["r"]
    scores = _first_scores(outputs)
    prompt = list(PROMPT.encode())
    assert [s.token_id for s in scores] == prompt[1:]
    # The fake scores name the position they were computed at: 1, 2, ... without gaps.
    assert [s.logprob for s in scores] == [-float(i) for i in range(1, len(prompt))]
    assert len(runner.batches) > 2  # it really ran in several chunks


def test_the_prefix_cache_is_not_used_for_prompt_logprobs() -> None:
    core, _ = make_core(FakeRunner(num_slots=2))
    submit(core, "warm", PROMPT, max_tokens=2, temperature=0.0)
    run_to_completion(core)
    request = submit(core, "scored", PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=0)
    outputs = run_to_completion(core)["scored"]
    assert request.sequences[0].num_cached_tokens == 0
    assert len(_first_scores(outputs)) == len(PROMPT) - 1
    plain = submit(core, "plain", PROMPT, max_tokens=2, temperature=0.0)
    run_to_completion(core)
    assert plain.sequences[0].num_cached_tokens > 0  # the cache itself still works
