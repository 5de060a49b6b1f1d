"""The prefix cache with recurrent-state snapshots (``state_snapshots.py``), paged and over
per-slot streams, on a fake runner whose "state" is every token a slot absorbed: it asserts,
at every chunk, that the state equals the slot's KV, so a snapshot tied to the wrong node,
restored into the wrong slot or taken back while still needed fails the request. Random
workloads compare with the cache off and check the books after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.outputs import RequestOutput
from slotserve.options import CacheBudget
from tests.engine.helpers import make_core, submit, text_of
from tests.fake_state_runners import RecurrentFakeRunner

SYSTEM = "You are a careful assistant. "  # 29 bytes: off the 8-token grid


def recurrent(places: int = 4, blocks: int = 200) -> RecurrentFakeRunner:
    """A paged pool of ``blocks`` blocks, or per-slot streams with 0."""
    return RecurrentFakeRunner(
        kv_pool_blocks=blocks, kv_block_size=4, max_seq_len=128, snapshot_places=places
    )


def texts_of(core: EngineCore, jobs: dict[str, tuple[str, int]]) -> dict[str, str]:
    """Runs ``jobs`` (id -> prompt, max tokens) together, checking the books after every
    step; every request must end well."""
    for rid, (prompt, max_tokens) in jobs.items():
        submit(core, rid, prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in jobs}
    while core.has_work:
        for output in core.step():
            assert output.error is None, output.error
            outputs[output.request_id].append(output)
        core.check_integrity()
    return {rid: text_of(outputs[rid]) for rid in jobs}


@pytest.mark.parametrize("blocks", [200, 0], ids=["paged", "streams"])
def test_a_conversation_resumes_each_turn_from_the_last_turns_prompt(blocks: int) -> None:
    runner = recurrent(blocks=blocks)
    core, _ = make_core(runner, prefix_cache_snapshot_interval=1000)
    prompt = SYSTEM + "Hi."
    for turn in range(3):
        reply = texts_of(core, {f"t{turn}": (prompt, 5)})[f"t{turn}"]
        core.check_integrity()
        prompt += reply + f" Turn {turn}."
    # Turns 2 and 3 resumed from the previous prompt's last multiple of 8. A stream also
    # takes that state when its turn ends, since its own state is past the reply by then.
    assert runner.restored == ([32, 40] if blocks else [32, 32, 40, 40, 56])
    assert all(position % 8 == 0 for position in runner.saved_at)
    assert core.prefix_cache.stats().hit_tokens == 32 + 40


def test_places_are_taken_back_least_recently_used_first() -> None:
    runner = recurrent(places=2)
    core, _ = make_core(runner, prefix_cache_snapshot_interval=1000)
    prompts = [f"{SYSTEM}Question number {i}, please." for i in range(3)]
    for i, prompt in enumerate(prompts):
        texts_of(core, {str(i): (prompt, 2)})
    stats = core.prefix_cache.stats()
    assert stats.snapshots == 2 and stats.snapshot_taken_back > 0
    # The first question's end was taken back; the last one's is still there.
    texts_of(core, {"again": (prompts[2], 2)})
    assert runner.restored[-1] == len(prompts[2]) // 8 * 8
    core.prefix_cache.flush()
    core.check_integrity()
    assert core.prefix_cache.stats().snapshots == 0


def test_a_preempted_sequence_resumes_from_a_snapshot_or_from_zero() -> None:
    """A pool too small for all four: preemption releases a slot mid-prompt (its unfilled
    places freed) and it resumes later; texts equal the cache off's."""
    jobs = {str(i): (SYSTEM * 2 + f"Task {i}." * 3, 20) for i in range(4)}
    off, _ = make_core(recurrent(blocks=60), prefix_cache=False)
    on, _ = make_core(recurrent(places=3, blocks=60), prefix_cache_snapshot_interval=16)
    assert texts_of(on, jobs) == texts_of(off, jobs)
    assert on.snapshot().preemptions > 0
    on.check_integrity()


stems = st.sampled_from([SYSTEM, SYSTEM * 2, "Tools: read, write, run. " * 3, ""])
prompts = st.tuples(stems, st.text(alphabet="abcdef ", min_size=1, max_size=30))
jobs = st.lists(
    st.lists(st.tuples(prompts, st.integers(1, 6)), min_size=1, max_size=4),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rounds=jobs,
    places=st.integers(1, 6),
    interval=st.sampled_from([8, 16, 40, 1000]),
    budget=st.sampled_from([None, 0, 40, 200]),
    blocks=st.sampled_from([0, 40, 200]),  # 0: per-slot streams
)
def test_random_workloads_equal_the_cache_off(
    rounds: list[list[tuple[tuple[str, str], int]]],
    places: int,
    interval: int,
    budget: int | None,
    blocks: int,
) -> None:
    options = {} if budget is None else {"prefix_cache_budget": CacheBudget(tokens=budget)}
    runner = recurrent(places=places, blocks=blocks)
    on, _ = make_core(
        runner,
        prefix_cache_snapshot_interval=interval,
        prefix_wait_min_tokens=8,
        **options,
    )
    off, _ = make_core(recurrent(blocks=blocks), prefix_cache=False)
    for index, round_ in enumerate(rounds):
        batch = {f"{index}.{i}": (stem + tail, n) for i, ((stem, tail), n) in enumerate(round_)}
        assert texts_of(on, batch) == texts_of(off, batch)
        on.check_integrity()
    assert all(position % 8 == 0 for position in runner.saved_at)
