"""The prefix cache over a paged KV pool: the radix tree holds the blocks of cached prefixes, so
a prefix outlives its owner and the slots' reuse, capacity follows free memory, and memory
pressure evicts least recently used prefixes before anyone is preempted. The fake runner's
"KV" is the tokens written into each block, so a wrongly shared block changes the output."""

from __future__ import annotations

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.slots import SlotState
from slotserve.engine.prefix_cache.paged_cache import PagedPrefixCache
from slotserve.options import CacheBudget
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import FakeRunner

PREFIX = "shared system prompt, " * 3  # 66 tokens (bytes)


def pooled(blocks: int, **options: object) -> FakeRunner:
    options.setdefault("max_seq_len", 128)
    return FakeRunner(kv_pool_blocks=blocks, kv_block_size=4, **options)  # type: ignore[arg-type]


def solo_text(prompt: str, max_tokens: int, max_seq_len: int = 128) -> str:
    core, _ = make_core(FakeRunner(max_seq_len=max_seq_len), prefix_cache=False)
    submit(core, "solo", prompt, max_tokens=max_tokens, ignore_eos=True)
    return text_of(run_to_completion(core)["solo"])


def check(core: EngineCore, runner: FakeRunner) -> None:
    core.check_integrity()  # tree spans, the pool's holds, every slot's KV
    for slot in core.scheduler.slots.slots:
        seq = slot.sequence
        if seq is not None and slot.state is not SlotState.PREEMPTED:
            assert runner.kv[slot.index] == seq.token_ids[: seq.num_computed_tokens]
        else:
            assert runner.kv[slot.index] == [], "a free slot holds no KV: the tree does"


def test_the_paged_runner_gets_the_cache_that_holds_blocks() -> None:
    core, _ = make_core(pooled(64))
    assert isinstance(core.prefix_cache, PagedPrefixCache)


def test_a_cached_prefix_survives_while_every_slot_is_busy_with_other_work() -> None:
    runner = pooled(200, num_slots=2)
    core, _ = make_core(runner)
    submit(core, "first", PREFIX + "question one", max_tokens=4, ignore_eos=True)
    run_to_completion(core)
    # Both slots now run unrelated prompts: with KV kept in free slots, both would have been
    # overwritten and the prefix lost.
    for request_id in ("busy0", "busy1"):
        submit(core, request_id, f"{request_id} unrelated work " * 2, max_tokens=30)
    for _ in range(10):
        core.step()
    assert [s.state for s in core.scheduler.slots.slots] == [SlotState.GENERATING] * 2
    stats = core.snapshot().prefix_cache
    assert stats.cached_tokens >= len(PREFIX + "question one") + 4, "the prefix is still cached"
    check(core, runner)
    run_to_completion(core)
    submit(core, "second", PREFIX + "question two", max_tokens=4, ignore_eos=True)
    second = run_to_completion(core)["second"]
    assert second[-1].num_cached_tokens == len(PREFIX + "question ")
    assert text_of(second) == solo_text(PREFIX + "question two", 4)
    assert runner.copies == [], "hits share blocks: no KV is copied"
    check(core, runner)


def test_cache_capacity_follows_free_memory_not_the_slot_count() -> None:
    runner = pooled(400, num_slots=1)
    core, _ = make_core(runner)
    prompts = [f"conversation {i}: " + PREFIX for i in range(6)]
    for i, prompt in enumerate(prompts):
        submit(core, f"r{i}", prompt, max_tokens=2, ignore_eos=True)
        run_to_completion(core)
    # One slot, six distinct prompts cached: all of them hit again.
    for i, prompt in enumerate(prompts):
        submit(core, f"again{i}", prompt, max_tokens=2, ignore_eos=True)
        assert run_to_completion(core)[f"again{i}"][-1].num_cached_tokens == len(prompt) - 1
    assert core.snapshot().prefix_cache.evictions == 0
    check(core, runner)


def test_memory_pressure_evicts_least_recently_used_prefixes_before_preempting() -> None:
    # 60 blocks of 4: three finished prompts of ~70 tokens fill most of the pool as cache.
    runner = pooled(60, num_slots=2, max_seq_len=120)
    core, _ = make_core(runner)
    prompts = {name: f"{name} " + PREFIX for name in ("old", "mid", "new")}
    for name, prompt in prompts.items():
        submit(core, name, prompt, max_tokens=2, ignore_eos=True)
        run_to_completion(core)
    submit(core, "touch", prompts["old"], max_tokens=2, ignore_eos=True)  # "old" used again
    run_to_completion(core)
    assert runner.blocks_in_use > 40
    big = "a different long prompt " * 4
    submit(core, "big", big, max_tokens=20, ignore_eos=True)
    out = run_to_completion(core)["big"]
    assert text_of(out) == solo_text(big, 20)
    assert core.snapshot().preemptions == 0
    assert core.snapshot().prefix_cache.evictions > 0
    # The least recently used prompt ("mid") went first; the one used again is still whole.
    for name, expect_hit in (("old", True), ("mid", False)):
        submit(core, f"probe-{name}", prompts[name], max_tokens=1)
        cached = run_to_completion(core)[f"probe-{name}"][-1].num_cached_tokens
        assert (cached == len(prompts[name]) - 1) is expect_hit, (name, cached)
    check(core, runner)


def test_concurrent_requests_with_one_prefix_share_its_blocks() -> None:
    runner = pooled(200, num_slots=4)
    core, _ = make_core(runner, max_batch_tokens=256)
    submit(core, "warm", PREFIX + "warm", max_tokens=1)
    run_to_completion(core)
    cached_blocks = runner.blocks_in_use
    for i in range(4):
        submit(core, f"r{i}", PREFIX + f"user {i}", max_tokens=3, ignore_eos=True)
    first = core.step()  # all four admitted and prefilled in one step
    shared = len(PREFIX) // 4
    # Each sequence adds only the blocks of its own suffix (and a copy of the boundary block).
    assert runner.blocks_in_use - cached_blocks <= 4 * (len(" user 0") // 4 + 2)
    assert runner.blocks_in_use < cached_blocks + 4 * shared
    outputs = run_to_completion(core)
    for i in range(4):
        steps = [o for o in first if o.request_id == f"r{i}"] + outputs[f"r{i}"]
        assert text_of(steps) == solo_text(PREFIX + f"user {i}", 3)
    check(core, runner)


def test_a_budget_of_zero_keeps_nothing_once_requests_end() -> None:
    runner = pooled(200, num_slots=2)
    core, _ = make_core(runner, prefix_cache_budget=CacheBudget(tokens=0))
    submit(core, "a", PREFIX, max_tokens=3)
    run_to_completion(core)
    assert core.snapshot().prefix_cache.cached_tokens == 0 and runner.blocks_in_use == 0
    check(core, runner)
