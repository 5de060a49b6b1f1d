"""Batch construction: token budget, chunked prefill, decode-first, slot reuse, admission."""

from __future__ import annotations

import pytest

from slotserve.engine.core.slots import SlotState
from tests.engine.helpers import make_core, run_to_completion, submit
from tests.fake_runner import FakeRunner


def test_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    core, runner = make_core(max_batch_tokens=16, prefill_chunk=8)
    submit(core, "long", "x" * 20, max_tokens=2, temperature=0)
    core.step()
    core.step()
    core.step()
    sizes = [[len(c.token_ids) for c in batch] for batch in runner.batches]
    assert sizes == [[8], [8], [4]]
    assert [c.sample for batch in runner.batches for c in batch] == [False, False, True]
    assert sum(c.slot == 0 for batch in runner.batches for c in batch) == 3  # three chunks


def test_every_generating_slot_decodes_every_step_beside_a_long_prefill() -> None:
    core, runner = make_core(max_batch_tokens=10, prefill_chunk=512)
    submit(core, "a", "hi", max_tokens=50, temperature=0)
    submit(core, "b", "yo", max_tokens=50, temperature=0)
    core.step()  # both prompts prefilled together
    submit(core, "long", "z" * 40, max_tokens=3, temperature=0)
    for _ in range(5):
        core.step()
    for batch in runner.batches[1:]:
        decode_slots = [c.slot for c in batch if len(c.token_ids) == 1 and c.sample]
        assert sorted(decode_slots)[:2] == [0, 1], "running streams must never be skipped"
        assert sum(len(c.token_ids) for c in batch) <= 10
    prefill = [len(c.token_ids) for batch in runner.batches[1:] for c in batch if c.slot == 2]
    assert prefill[:4] == [8, 8, 8, 8]  # budget 10 minus two decode tokens


def test_a_prefill_over_a_long_context_is_the_steps_last() -> None:
    """An agent's next turn: a few new tokens over a long cached conversation, whose attention
    outweighs their projections (from position 1 / context_cost = 64 on). A short prompt that
    came with it waits for the next step rather than delay its first token; without a
    context cost both go in one step."""
    prefix = "s" * 200
    for cost, together in ((1 / 64, False), (0.0, True)):
        runner = FakeRunner(context_cost=cost, max_seq_len=1024)
        core, _ = make_core(runner, max_batch_tokens=64, prefill_chunk=64)
        submit(core, "turn 1", prefix + "a", max_tokens=1, temperature=0)
        run_to_completion(core)
        runner.batches.clear()
        submit(core, "turn 2", prefix + "b" * 9, max_tokens=1, temperature=0)
        submit(core, "other", "o" * 12, max_tokens=1, temperature=0)
        core.step()
        assert sorted(len(c.token_ids) for c in runner.batches[0]) == (
            [9, 12] if together else [9]
        ), cost
        run_to_completion(core)
        if not together:  # the next step: the short prompt (the turn ended with its token)
            assert [len(c.token_ids) for c in runner.batches[1]] == [12]


def test_a_short_prompt_joins_a_chunk_before_the_long_context() -> None:
    """A long prompt's first chunks start before position 1 / context_cost: others share
    their step as usual; its chunks past that point run without them."""
    runner = FakeRunner(context_cost=1 / 64, max_seq_len=1024)
    core, _ = make_core(runner, max_batch_tokens=64, prefill_chunk=32)
    submit(core, "long", "x" * 160, max_tokens=1, temperature=0)
    submit(core, "short", "y" * 8, max_tokens=1, temperature=0)
    core.step()
    assert sorted(len(c.token_ids) for c in runner.batches[0]) == [8, 32]
    core.step()  # long: 32 .. 63, beside the short one's decode
    submit(core, "later", "z" * 8, max_tokens=1, temperature=0)
    run_to_completion(core)
    chunks = [(c.start_pos, len(c.token_ids)) for b in runner.batches for c in b if c.slot == 0]
    assert chunks[:5] == [(0, 32), (32, 32), (64, 32), (96, 32), (128, 32)]
    for batch in runner.batches:  # no prompt chunk beside long's chunks from position 64 on
        if any(c.slot == 0 and c.start_pos >= 64 and not c.sample for c in batch):
            assert [c.slot for c in batch if len(c.token_ids) > 1] == [0]


def test_prefill_slots_are_served_oldest_first() -> None:
    core, runner = make_core(max_batch_tokens=12, prefill_chunk=8)
    submit(core, "first", "a" * 16, max_tokens=1, temperature=0)
    submit(core, "second", "b" * 16, max_tokens=1, temperature=0)
    core.step()
    assert [(c.slot, len(c.token_ids)) for c in runner.batches[0]] == [(0, 8), (1, 4)]


def test_slots_are_reused_after_a_request_finishes() -> None:
    runner = FakeRunner(num_slots=2)
    core, _ = make_core(runner)
    for i in range(5):
        submit(core, f"r{i}", f"prompt {i}", max_tokens=3, temperature=0)
    outputs = run_to_completion(core)
    assert len(outputs) == 5 and all(o[-1].finished for o in outputs.values())
    # Five requests through two slots: every slot was taken more than once.
    assert len(runner.added) == 5 and set(runner.added) == {0, 1}
    assert len(runner.removed) == 5
    assert all(s.state is SlotState.FREE for s in core.scheduler.slots.slots)
    assert runner.active == set()
    core.check_integrity()


def test_request_with_n_sequences_waits_for_n_free_slots() -> None:
    runner = FakeRunner(num_slots=3)
    core, _ = make_core(runner)
    submit(core, "busy", "q", max_tokens=5, temperature=0)
    submit(core, "pair", "p", max_tokens=2, temperature=0, n=3)
    core.step()
    states = [s.state for s in core.scheduler.slots.slots]
    assert states.count(SlotState.FREE) == 2, "n=3 must not start with only two free slots"
    outputs = run_to_completion(core)
    final = outputs["pair"][-1]
    assert final.finished and final.num_output_tokens == 6


def test_runner_can_ask_for_equal_prefill_chunks_per_step() -> None:
    core, runner = make_core(FakeRunner(equal_prefill_chunks=True), max_batch_tokens=64)
    for name, length in (("a", 10), ("b", 12), ("c", 15)):
        submit(core, name, "x" * length, max_tokens=20, temperature=0)
    for _ in range(4):
        core.step()
    assert [len(c.token_ids) for c in runner.batches[0]] == [10, 10, 10]
    # The leftovers (2 and 5 tokens) ride along with decode steps, one length per step.
    assert [len(c.token_ids) for c in runner.batches[1]] == [1, 2, 2]
    assert [len(c.token_ids) for c in runner.batches[2]] == [1, 1, 3]


def test_equal_chunks_keep_oldest_first_under_the_budget() -> None:
    core, runner = make_core(FakeRunner(equal_prefill_chunks=True), max_batch_tokens=50)
    for name, length in (("a", 30), ("b", 31), ("c", 40)):
        submit(core, name, "y" * length, max_tokens=2, temperature=0)
    core.step()
    # a fits whole; the budget cuts b short, and b is not counted as a whole chunk (trimming
    # a to b's 20 tokens would only stall a); c waits for the next step.
    assert [(c.slot, len(c.token_ids)) for c in runner.batches[0]] == [(0, 30), (1, 20)]
    core.step()
    # b's 11 leftover tokens are the shortest whole chunk: c (cut by the budget) is trimmed
    # to it rather than adding a ragged sub-batch.
    assert [(c.slot, len(c.token_ids)) for c in runner.batches[1]] == [(0, 1), (1, 11), (2, 11)]


def test_a_chunk_cap_shorter_than_the_odd_part_and_a_grain_is_exceeded_not_stuck() -> None:
    # 28 tokens in grains of 8 leave an odd 4 for the first chunk, which must also be at
    # least a grain: 12 tokens, past the cap of 8 by less than a grain; then whole grains.
    runner = FakeRunner(prefill_grain=8)
    core, _ = make_core(runner, max_batch_tokens=32, prefill_chunk=8)
    submit(core, "a", "p" * 28, max_tokens=2)
    out = run_to_completion(core, max_steps=50)
    assert out["a"][-1].finished
    assert runner.prompt_chunks == [(0, 12, 28), (12, 8, 28), (20, 8, 28)]


def test_limits_that_cannot_fit_two_grains_are_refused() -> None:
    with pytest.raises(ValueError, match="two grains"):
        make_core(FakeRunner(prefill_grain=8), max_batch_tokens=18, num_slots=4)
