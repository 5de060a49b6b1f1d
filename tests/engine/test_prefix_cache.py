"""The prefix cache through the engine, with the fake runner (whose output depends on the KV it
holds, so a wrongly reused prefix changes the text)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.slots import SlotState
from slotserve.options import CacheBudget
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import FakeRunner

SYSTEM = "You are a careful assistant. " * 8  # 232 bytes = tokens


def fake(**options: object) -> FakeRunner:
    options.setdefault("max_seq_len", 512)
    return FakeRunner(**options)  # type: ignore[arg-type]


def assert_kv_consistent(core: EngineCore, runner: FakeRunner) -> None:
    """Every slot's KV holds exactly what the engine believes, token for token."""
    core.check_integrity()
    cache = core.prefix_cache
    for slot in core.scheduler.slots.slots:
        held = runner.kv[slot.index]
        if slot.sequence is not None:
            seq = slot.sequence
            assert held == seq.token_ids[: seq.num_computed_tokens], f"slot {slot.index}"
        else:  # free: what the cache records (nothing when it is off or holds blocks itself)
            assert held == cache.held_tokens(slot.index), f"slot {slot.index}"


def _prefill_tokens(runner: FakeRunner) -> int:
    return sum(len(c.token_ids) for batch in runner.batches for c in batch if not c.sample)


def test_identical_prompts_back_to_back_hit_the_cache() -> None:
    core, runner = make_core(fake(replies={SYSTEM: b"ok"}))
    outputs = []
    for i in range(4):
        submit(core, f"r{i}", SYSTEM, max_tokens=8)
        outputs.append(run_to_completion(core)[f"r{i}"])
        assert_kv_consistent(core, runner)
    assert [text_of(o) for o in outputs] == ["ok"] * 4
    cached = [o[-1].num_cached_tokens for o in outputs]
    assert cached == [0] + [len(SYSTEM) - 1] * 3  # the last prompt token is always computed
    stats = core.snapshot().prefix_cache
    assert (stats.hits, stats.misses) == (3, 1)
    assert stats.hit_tokens == 3 * (len(SYSTEM) - 1) and stats.query_tokens == 4 * len(SYSTEM)
    assert runner.copies == [], "the slot holding the prefix is reused in place"
    # What the hits are set against: the prompt tokens computed, and the time they took.
    assert stats.computed_tokens == len(SYSTEM) + 3 and stats.compute_seconds > 0


def test_shared_system_prompt_is_copied_into_a_busy_neighbours_slot() -> None:
    runner = fake(num_slots=2)
    core, _ = make_core(runner, prefix_wait_min_tokens=10_000)
    submit(core, "a", SYSTEM + "question A", max_tokens=30)
    while core.scheduler.slots.slots[0].state is not SlotState.GENERATING:
        core.step()
    submit(core, "b", SYSTEM + "question B", max_tokens=3)
    out = run_to_completion(core)
    assert out["b"][-1].num_cached_tokens == len(SYSTEM + "question ")
    assert runner.copies == [(0, 1, len(SYSTEM + "question "))]
    assert_kv_consistent(core, runner)


def test_output_is_the_same_with_the_cache_on_and_off() -> None:
    def run(prefix_cache: bool) -> dict[str, str]:
        runner = fake(num_slots=3)
        core, _ = make_core(runner, prefix_cache=prefix_cache, max_batch_tokens=64)
        for i in range(9):
            submit(core, f"r{i}", SYSTEM + f"user {i % 4}" * (i % 3 + 1), max_tokens=5 + i)
        out = run_to_completion(core)
        assert_kv_consistent(core, runner)
        return {rid: text_of(o) for rid, o in out.items()}

    assert run(True) == run(False)


def test_requests_arriving_together_compute_a_new_shared_prompt_once() -> None:
    runner = fake(num_slots=4)
    core, _ = make_core(runner, max_batch_tokens=128, prefill_chunk=64, prefix_wait_min_tokens=64)
    for i in range(4):
        submit(core, f"r{i}", SYSTEM + f"user {i}", max_tokens=4)
    out = run_to_completion(core)
    unique = len("user 0")
    # The shared part is computed once; the others wait for it, then reuse it.
    assert _prefill_tokens(runner) <= len(SYSTEM) + 4 * unique
    assert sorted(o[-1].num_cached_tokens for o in out.values()) == [0] + [len(SYSTEM) + 5] * 3
    assert_kv_consistent(core, runner)


def test_a_short_shared_preamble_does_not_make_requests_wait() -> None:
    runner = fake(num_slots=4)
    core, _ = make_core(runner, max_batch_tokens=512)
    for i in range(4):
        submit(core, f"r{i}", f"Hi. question {i} " * 10, max_tokens=2)
    core.step()
    assert all(s.state is not SlotState.FREE for s in core.scheduler.slots.slots)


def test_tiny_budget_evicts_and_keeps_serving_correctly() -> None:
    prompts = [f"{c}" * 40 + "tail" for c in "abcdef"]
    runner = fake(num_slots=2)
    core, _ = make_core(runner, prefix_cache_budget=CacheBudget(tokens=50))
    for i, prompt in enumerate(prompts * 2):
        submit(core, f"r{i}", prompt, max_tokens=3)
        run_to_completion(core)
        assert core.snapshot().prefix_cache.evictable_tokens <= 50
        assert_kv_consistent(core, runner)
    assert core.snapshot().prefix_cache.evictions > 0


def test_abort_mid_prefill_leaves_the_tree_consistent_and_the_prefix_reusable() -> None:
    runner = fake(num_slots=2)
    core, _ = make_core(runner, max_batch_tokens=33, prefill_chunk=32)
    submit(core, "a", SYSTEM, max_tokens=4)
    core.step()
    core.step()
    core.abort("a")
    core.step()
    assert_kv_consistent(core, runner)
    submit(core, "b", SYSTEM, max_tokens=4)
    out = run_to_completion(core)
    assert out["b"][-1].num_cached_tokens == 64
    assert_kv_consistent(core, runner)


def test_runner_failure_drops_the_slots_kv() -> None:
    runner = fake(num_slots=2)
    core, _ = make_core(runner)
    submit(core, "a", SYSTEM, max_tokens=4)
    run_to_completion(core)
    runner.fail_on_execute = True
    submit(core, "b", SYSTEM + "more", max_tokens=4)
    out = run_to_completion(core)
    assert out["b"][-1].error is not None and core.unhealthy is not None
    # "b" ran in slot 0 on "a"'s cached prefix: its half-written KV is dropped with it.
    assert all(held == [] for held in runner.kv.values())
    runner.fail_on_execute = False
    fresh, _ = make_core(runner)  # a reload: the new engine starts from empty KV
    submit(fresh, "c", SYSTEM, max_tokens=4)
    assert run_to_completion(fresh)["c"][-1].num_cached_tokens == 0
    assert_kv_consistent(fresh, runner)


def test_cache_off_frees_kv_and_reports_why() -> None:
    runner = fake()
    core, _ = make_core(runner, prefix_cache=False)
    submit(core, "a", SYSTEM, max_tokens=4)
    out = run_to_completion(core)
    assert out["a"][-1].num_cached_tokens == 0 and not core.prefix_cache.enabled
    assert all(held == [] for held in runner.kv.values())
    stats = core.snapshot().prefix_cache
    assert not stats.enabled and "--no-prefix-cache" in (stats.disabled_reason or "")
    assert_kv_consistent(core, runner)


def test_model_without_range_sharing_runs_without_cache(caplog: pytest.LogCaptureFixture) -> None:
    runner = fake(prefix_cache_unsupported="the model keeps recurrent state")
    with caplog.at_level(logging.WARNING):
        core = EngineCore(runner, EngineConfig(num_slots=4))
    assert not core.prefix_cache.enabled
    assert core.snapshot().prefix_cache.disabled_reason == "the model keeps recurrent state"
    assert "prefix cache disabled: the model keeps recurrent state" in caplog.text


def test_an_unrelated_request_takes_an_empty_slot_not_cached_content() -> None:
    runner = fake(num_slots=3)
    core, _ = make_core(runner)
    submit(core, "a", SYSTEM, max_tokens=2)
    run_to_completion(core)
    cached_slot = next(s for s, held in runner.kv.items() if held)
    submit(core, "b", "something else entirely", max_tokens=2)
    core.step()
    assert core.scheduler.slots.slots[cached_slot].state is SlotState.FREE
    run_to_completion(core)
    submit(core, "c", SYSTEM, max_tokens=2)
    assert run_to_completion(core)["c"][-1].num_cached_tokens == len(SYSTEM) - 1


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", SYSTEM[:40], SYSTEM[:120], SYSTEM]),
            st.text(alphabet="xyz", min_size=1, max_size=12),
            st.integers(1, 12),
            st.integers(0, 6),  # steps before aborting (0: never)
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([None, 0, 40, 300]),
    st.sampled_from([1, 4]),
)
def test_random_workloads_keep_kv_consistent_and_outputs_unchanged(
    requests: list[tuple[str, str, int, int]], budget: int | None, grain: int
) -> None:
    def run(prefix_cache: bool) -> dict[str, str]:
        runner = fake(num_slots=3, prefill_grain=grain, equal_prefill_chunks=grain > 1)
        core, _ = make_core(
            runner,
            prefix_cache=prefix_cache,
            prefix_cache_budget=CacheBudget(tokens=budget),
            max_batch_tokens=48,
            prefill_chunk=32,
            prefix_wait_min_tokens=30,
        )
        for i, (prefix, own, max_tokens, _) in enumerate(requests):
            submit(core, f"r{i}", prefix + own, max_tokens=max_tokens)
        texts: dict[str, str] = {}
        for step in range(1, 10_000):
            for i, (*_, abort_after) in enumerate(requests):
                if abort_after == step:
                    core.abort(f"r{i}")
            for output in core.step():
                texts[output.request_id] = texts.get(output.request_id, "") + "".join(
                    d.text for d in output.deltas
                )
            assert_kv_consistent(core, runner)
            if not core.has_work:
                break
        aborted = {f"r{i}" for i, r in enumerate(requests) if r[3]}
        return {rid: text for rid, text in texts.items() if rid not in aborted}

    assert run(True) == run(False)


def test_prompt_chunks_are_at_least_a_grain_and_only_prompts_are_cached() -> None:
    runner = fake(num_slots=3, prefill_grain=8, equal_prefill_chunks=True)
    core, _ = make_core(runner, max_batch_tokens=40, prefill_chunk=16, prefix_wait_min_tokens=8)
    prompts = {"a": SYSTEM[:45], "b": SYSTEM[:45] + "and b", "c": "x" * 21, "d": "short"}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, max_tokens=6)
    out = run_to_completion(core)
    assert_kv_consistent(core, runner)
    assert runner.prompt_chunks
    for start, length, prompt_length in runner.prompt_chunks:
        if prompt_length < 8:  # a prompt shorter than a grain is one chunk
            assert (start, length) == (0, prompt_length)
        else:  # invariant 8: a grain or more, leaving whole grains
            assert length >= 8 and (prompt_length - start - length) % 8 == 0
    # "b" waited for "a" and reused its prompt, leaving whole grains to compute.
    assert out["b"][-1].num_cached_tokens == 50 - 8
    cache = core.prefix_cache
    assert cache is not None
    # Whole prompts stay cached (not outputs, not a prompt shorter than a grain).
    held = sorted(len(cache.held_tokens(slot)) for slot in range(3))
    assert set(held) <= {0, 21, 45, 50} and 50 in held


def test_a_match_too_short_to_reuse_leaves_the_holder_alone() -> None:
    runner = fake(num_slots=2, prefill_grain=8)
    core, _ = make_core(runner)
    submit(core, "a", SYSTEM[:40], max_tokens=2)
    run_to_completion(core)
    holder = next(slot for slot, held in runner.kv.items() if held)
    # 5 shared tokens, but less than a grain would be left to compute before the remainder.
    submit(core, "b", SYSTEM[:5] + "xyz", max_tokens=2)
    assert run_to_completion(core)["b"][-1].num_cached_tokens == 0
    assert runner.kv[holder] == list(SYSTEM[:40].encode())
    submit(core, "c", SYSTEM[:40], max_tokens=2)
    assert run_to_completion(core)["c"][-1].num_cached_tokens == 32


def test_a_hit_ends_anywhere_that_leaves_whole_grains_to_compute() -> None:
    runner = fake(num_slots=2, prefill_grain=8)
    core, _ = make_core(runner)
    submit(core, "a", SYSTEM[:40], max_tokens=2)
    run_to_completion(core)
    submit(core, "b", SYSTEM[:13] + "x" * 20, max_tokens=2)  # 33 tokens, 13 cached
    assert run_to_completion(core)["b"][-1].num_cached_tokens == 9  # 33 - 9 = 3 grains
    assert runner.prompt_chunks[-1] == (9, 24, 33)  # the rest in one chunk
    submit(core, "c", SYSTEM[:13] + "x" * 3, max_tokens=2)  # 16 tokens, 15 cached
    assert run_to_completion(core)["c"][-1].num_cached_tokens == 8  # a grain is computed
    assert_kv_consistent(core, runner)
