"""Speculative decoding on both real runners (SPEC E12): tokens and log-probabilities are the
same with and without drafts, alone and beside other sequences; seeded samples too; the KV of
rejected drafts is rolled back (the engine's integrity check runs after every step)."""

from __future__ import annotations

import pytest

from slotserve.engine.config import EngineConfig, SpeculativeConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import Runner
from slotserve.engine.sampling_params import SamplingParams
from slotserve.engine.verify_cost import VerifyCost
from tests.prompts import PROMPTS
from tests.runner.conftest import require_batch_invariance

# Input-grounded: the model copies text it was given, so prompt lookup finds its drafts.
GROUNDED = (
    "Copy the list exactly.\nList: red apple, green pear, blue plum, red apple, green pear, "
    "blue plum, red apple, green pear, blue plum.\nCopy: red apple, green pear,"
)

Result = tuple[list[int], list[float], str | None]


def run(
    runner: Runner,
    speculative: SpeculativeConfig | None,
    jobs: dict[str, tuple[str, SamplingParams]],
    runner_cost: bool = False,
) -> tuple[dict[str, Result], EngineCore]:
    """Runs ``jobs`` to the end. Drafts are verified at every chance unless ``runner_cost``:
    these tests are about what verification returns; which drafts pay is the cost model's
    (tests/engine/test_speculative.py)."""
    core = EngineCore(
        runner, EngineConfig(num_slots=8, prefix_cache=False, speculative=speculative)
    )
    speculator = core.scheduler.speculator
    if speculator is not None and not runner_cost:
        speculator.verify_cost = VerifyCost(first=0.0, per_draft=0.0)
    results: dict[str, Result] = {rid: ([], [], None) for rid in jobs}
    for rid, (prompt, params) in jobs.items():
        core.add_request(EngineCoreRequest(rid, runner.tokenizer.encode(prompt), params))
    while core.has_work:
        for out in core.step():
            tokens, logprobs, _ = results[out.request_id]
            for delta in out.deltas:
                tokens.extend(delta.token_ids)
                logprobs.extend(s.logprob or 0.0 for s in delta.logprobs or [])
                if delta.finish_reason is not None:
                    results[out.request_id] = (tokens, logprobs, delta.finish_reason)
            assert out.error is None, out.error
        core.check_integrity()  # each slot's KV is exactly what its sequence computed
    return results, core


def greedy(n: int = 48, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_tokens_and_logprobs_match_without_drafts(any_runner: Runner, k: int) -> None:
    require_batch_invariance(any_runner)
    config = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=8)
    alone_jobs = {"grounded": (GROUNDED, greedy())}
    batched_jobs = {**alone_jobs, "p0": (PROMPTS[0], greedy(24)), "p1": (PROMPTS[1], greedy(40))}
    plain, _ = run(any_runner, None, batched_jobs)
    alone, core = run(any_runner, config, alone_jobs)
    assert alone["grounded"] == plain["grounded"]
    counters = core.snapshot().spec_decode
    assert counters is not None and counters.num_accepted_tokens > 0, "no draft was accepted"
    batched, core = run(any_runner, config, batched_jobs)
    assert batched == plain
    counters = core.snapshot().spec_decode
    assert counters is not None and counters.num_drafts > 0


def test_seeded_samples_match_without_drafts(any_runner: Runner) -> None:
    require_batch_invariance(any_runner)
    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8)
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True, logprobs=1)
    jobs = {"grounded": (GROUNDED, params), "other": (PROMPTS[2], params)}
    plain, _ = run(any_runner, None, jobs)
    drafted, core = run(any_runner, config, jobs)
    assert drafted == plain
    counters = core.snapshot().spec_decode
    assert counters is not None and counters.num_drafts > 0


def test_a_stop_inside_an_accepted_run_and_the_kv_left_behind(any_runner: Runner) -> None:
    require_batch_invariance(any_runner)
    plain, _ = run(any_runner, None, {"g": (GROUNDED, greedy())})
    stop_token = plain["g"][0][12]  # a token of the copied list, well inside the output
    jobs = {"g": (GROUNDED, greedy(stop_token_ids=[stop_token]))}
    expected, _ = run(any_runner, None, jobs)
    assert expected["g"][2] == "stop"
    drafted, core = run(any_runner, SpeculativeConfig(num_speculative_tokens=8), jobs)
    assert drafted == expected
    # With the cache off every slot's KV is freed at the end: nothing of the drafts is left.
    assert all(any_runner.kv_tokens(slot) == 0 for slot in range(8))
    counters = core.snapshot().spec_decode
    assert counters is not None and counters.num_accepted_tokens > 0


def test_the_runners_own_cost_drafts_on_a_copy(any_runner: Runner) -> None:
    require_batch_invariance(any_runner)
    # At the runner's measured cost (half a step per draft on llama.cpp) a copy still drafts.
    jobs = {"g": (GROUNDED, greedy(64))}
    plain, _ = run(any_runner, None, jobs)
    drafted, core = run(any_runner, SpeculativeConfig(num_speculative_tokens=4), jobs, True)
    assert drafted == plain
    counters = core.snapshot().spec_decode
    assert counters is not None and counters.num_accepted_tokens >= 8, counters
