"""The prefix cache's host-RAM tier: its own bookkeeping, and through the engine with the fake
runner (whose output depends on the KV it holds, so a wrongly restored state changes the text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.prefix_cache.host_tier import HostTier
from slotserve.engine.prefix_cache.slot_cache import SlotPrefixCache
from tests.engine.helpers import make_core, run_to_completion, submit, text_of, texts_in_waves
from tests.engine.test_prefix_cache import assert_kv_consistent
from tests.fake_runner import FakeRunner
from tests.fake_state_runners import SavingFakeRunner

SYSTEM = "You are a careful assistant who checks every step twice. " * 4  # 228 tokens
# Random workloads for ``texts_in_waves``: prompts sharing prefixes of the system prompt or not.
WAVE_REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(["", SYSTEM[:40], SYSTEM[:90], SYSTEM, "z" * 150]),
        st.text(alphabet="abcxyz ", min_size=1, max_size=60),
        st.integers(1, 6),  # max tokens
        st.integers(0, 4),  # the request's wave: each wave runs after the last
    ),
    min_size=1,
    max_size=14,
)
RAM_BUDGETS = st.sampled_from([0, 600, 2_000, 1 << 20])


def _state(path: list[int]) -> bytearray:
    return bytearray(4 * len(path))


# ---- the tier's bookkeeping -------------------------------------------------------------------


def test_a_longer_path_replaces_the_state_it_covers_and_a_covered_one_is_not_kept() -> None:
    tier = HostTier(budget_bytes=10_000)
    base = list(range(100))
    assert tier.save(base, lambda: _state(base))
    assert tier.covers(base[:40]) and not tier.covers([*base, 1])
    longer = [*base, *range(500, 550)]
    assert tier.save(longer, lambda: _state(longer))
    assert (tier.entries, tier.bytes) == (1, 4 * 150), "the longer state covers the first"
    assert not tier.save(base[:60], lambda: _state(base[:60])), "already covered"
    match = tier.match([*base[:70], 9999])
    assert match is not None and (match.length, match.leaf.end) == (70, 150)
    tier.check_integrity()


def test_states_of_diverging_paths_are_matched_apart_and_evicted_least_recent_first() -> None:
    tier = HostTier(budget_bytes=4 * 250)
    a, b = [*range(50), *range(100, 150)], [*range(50), *range(200, 250)]
    tier.save(a, lambda: _state(a))
    tier.save(b, lambda: _state(b))
    match_a, match_b = tier.match([*a, 7]), tier.match([*b[:80], 7])
    assert match_a is not None and match_b is not None
    assert (match_a.length, match_b.length) == (100, 80)
    assert match_a.leaf is not match_b.leaf
    assert tier.load(match_a) is not None  # a is now the more recently used
    c = list(range(300, 380))
    tier.save(c, lambda: _state(c))  # 80 more tokens' bytes: b, the least recent, goes
    assert tier.covers(a) and tier.covers(c) and not tier.covers(b[:60])
    assert tier.counters.evictions == 1
    tier.check_integrity()
    assert tier.clear() == 180 and (tier.entries, tier.bytes) == (0, 0)
    assert tier.tree.num_nodes == 0
    tier.check_integrity()


def test_a_state_larger_than_the_whole_budget_is_not_kept() -> None:
    tier = HostTier(budget_bytes=100)
    path = list(range(50))
    assert not tier.save(path, lambda: _state(path))
    assert tier.entries == 0 and tier.tree.num_nodes == 0
    tier.check_integrity()


# ---- through the engine -----------------------------------------------------------------------


def _two_slot_core(**config: object) -> tuple[EngineCore, SavingFakeRunner]:
    runner = SavingFakeRunner(num_slots=2, max_seq_len=512)
    core, _ = make_core(runner, **config)
    assert isinstance(runner, SavingFakeRunner)
    return core, runner


def _evict_from_slots(core: EngineCore) -> None:
    """Two unrelated long prompts take both slots: whatever they held must go."""
    submit(core, "x", "x" * 200, max_tokens=4)
    submit(core, "y", "y" * 200, max_tokens=4)
    run_to_completion(core)


def _answer_then_push_out(core: EngineCore, prompt: str, max_tokens: int = 12) -> str:
    """Runs ``prompt`` alone, then two other prompts over both slots; returns its text."""
    submit(core, "a", prompt, max_tokens=max_tokens)
    text = text_of(run_to_completion(core)["a"])
    _evict_from_slots(core)
    return text


def test_a_prefix_pushed_out_of_the_slots_is_restored_from_host_ram() -> None:
    core, runner = _two_slot_core(prefix_cache_ram=1 << 20)
    prompt = SYSTEM + "Question one?"
    first = _answer_then_push_out(core, prompt)
    start = list(prompt.encode()[:10])
    assert all(core.prefix_cache.held_tokens(s)[:10] != start for s in range(2))
    assert runner.saves, "the slot's content was saved before it was overwritten"
    submit(core, "b", prompt, max_tokens=12)
    again = run_to_completion(core)["b"]
    assert text_of(again) == first
    assert again[-1].num_cached_tokens == len(prompt) - 1
    assert len(runner.restores) == 1
    stats = core.snapshot().prefix_cache
    assert stats.host_hits == 1 and stats.host_hit_tokens == len(prompt) - 1
    assert stats.host_states >= 1 and 0 < stats.host_bytes <= stats.host_budget_bytes
    assert stats.as_dict()["tiers"]["host_ram"]["hits"] == 1  # type: ignore[index]
    assert_kv_consistent(core, runner)


def test_a_refused_restore_computes_the_prompt_and_the_text_is_unchanged() -> None:
    core, runner = _two_slot_core(prefix_cache_ram=1 << 20)
    prompt = SYSTEM + "Question two?"
    first = _answer_then_push_out(core, prompt)
    runner.refuse_restores = True
    submit(core, "b", prompt, max_tokens=12)
    again = run_to_completion(core)["b"]
    assert text_of(again) == first and again[-1].num_cached_tokens == 0
    assert core.snapshot().prefix_cache.host_hits == 0
    assert_kv_consistent(core, runner)


def test_flush_empties_host_ram_too_and_zero_turns_the_tier_off() -> None:
    core, _ = _two_slot_core(prefix_cache_ram=1 << 20)
    _answer_then_push_out(core, SYSTEM + "Question three?", max_tokens=4)
    assert core.snapshot().prefix_cache.host_states >= 1
    assert core.flush_prefix_cache() > 0
    stats = core.snapshot().prefix_cache
    assert (stats.host_states, stats.host_bytes, stats.cached_tokens) == (0, 0, 0)
    off, off_runner = _two_slot_core(prefix_cache_ram=0)
    assert isinstance(off.prefix_cache, SlotPrefixCache) and off.prefix_cache.host is None
    _answer_then_push_out(off, SYSTEM, max_tokens=4)
    assert off_runner.saves == [] and off.snapshot().prefix_cache.host_budget_bytes == 0


def test_a_runner_without_the_state_api_gets_no_host_tier() -> None:
    core, _ = make_core(FakeRunner(num_slots=2), prefix_cache_ram=1 << 20)
    assert isinstance(core.prefix_cache, SlotPrefixCache) and core.prefix_cache.host is None


@pytest.mark.parametrize("grain", [1, 4])
def test_three_conversations_on_two_slots_restore_every_turn_and_match_no_cache(
    grain: int,
) -> None:
    prefixes = [c * 150 for c in "pqr"]

    def run(prefix_cache: bool, ram: int) -> tuple[dict[str, str], list[int], SavingFakeRunner]:
        runner = SavingFakeRunner(
            num_slots=2, max_seq_len=512, prefill_grain=grain, equal_prefill_chunks=grain > 1
        )
        core, _ = make_core(
            runner, prefix_cache=prefix_cache, prefix_cache_ram=ram, prefill_chunk=32
        )
        history = list(prefixes)
        texts: dict[str, str] = {}
        cached: list[int] = []
        for turn in range(4):
            for k in range(3):  # one request at a time: each turn finds its slot overwritten
                history[k] += f" turn {turn}?"
                rid = f"c{k}t{turn}"
                submit(core, rid, history[k], max_tokens=5)
                outputs = run_to_completion(core)[rid]
                texts[rid] = text_of(outputs)
                cached.append(outputs[-1].num_cached_tokens)
                history[k] += texts[rid]
                assert_kv_consistent(core, runner)
        return texts, cached, runner

    with_host, cached, runner = run(True, 1 << 20)
    slots_only, cached_in_slots, _ = run(True, 0)
    without, _, _ = run(False, 0)
    assert with_host == slots_only == without
    assert all(c >= 150 for c in cached[3:]), "every later turn reuses its history"
    assert sum(c < 150 for c in cached_in_slots[3:]) >= 3, "two slots cannot keep three"
    assert len(runner.restores) >= 3


@pytest.mark.parametrize("grain", [1, 4])
@settings(max_examples=40, deadline=None)
@given(requests=WAVE_REQUESTS, ram=RAM_BUDGETS, refuse=st.booleans())
def test_random_workloads_give_the_text_of_no_cache_whatever_the_tiers_do(
    grain: int, requests: list[tuple[str, str, int, int]], ram: int, refuse: bool
) -> None:
    def run(prefix_cache: bool) -> dict[str, str]:
        runner = SavingFakeRunner(
            num_slots=2,
            max_seq_len=512,
            prefill_grain=grain,
            equal_prefill_chunks=grain > 1,
            refuse_restores=refuse,
        )
        core, _ = make_core(
            runner,
            prefix_cache=prefix_cache,
            prefix_cache_ram=ram,
            max_batch_tokens=48,
            prefill_chunk=32,
            prefix_wait_min_tokens=30,
        )
        return texts_in_waves(core, requests, lambda: assert_kv_consistent(core, runner))

    assert run(True) == run(False)


# ---- the disk tier beneath RAM ----------------------------------------------------------------


def test_states_spill_to_disk_stay_matchable_and_survive_a_restart(tmp_path: Path) -> None:
    def tier(ram: int) -> HostTier:
        return HostTier(ram, tmp_path, "model-a", disk_budget_bytes=1 << 20)

    first = tier(4 * 150)
    a, b = list(range(100)), list(range(1000, 1100))
    first.save(a, lambda: _state(a))
    first.save(b, lambda: _state(b))  # RAM holds one: a goes to disk
    assert first.bytes == 400 and first.disk is not None and len(first.disk) == 1
    match = first.match([*a[:60], 5])
    assert match is not None and match.length == 60
    loaded = first.load(match)
    assert loaded is not None and loaded[1] and loaded[0] == _state(a), "read back from disk"
    assert first.bytes == 400 and len(first.disk) == 2, "a back in RAM pushed b to disk"
    c = list(range(2000, 2100))
    first.save(c, lambda: _state(c))  # a leaves RAM again: it is on disk already
    assert first.counters.evictions == 3 and len(first.disk) == 2
    first.check_integrity()
    assert first.persist() == 1  # c, only in RAM, is written too
    restarted = tier(4 * 150)
    assert restarted.entries == 3 and restarted.bytes == 0
    again = restarted.match([*b, 5])
    assert again is not None and again.length == 100
    assert restarted.load(again) == (_state(b), True)
    restarted.check_integrity()
    other = HostTier(4 * 150, tmp_path, "model-b", disk_budget_bytes=1 << 20)
    assert other.entries == 0 and other.match([*a, 5]) is None, "another model's states"


def test_a_damaged_file_is_a_miss_and_the_state_is_forgotten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = HostTier(1 << 20, tmp_path, "model-a", disk_budget_bytes=1 << 20)
    path = list(range(100))
    first.save(path, lambda: bytearray(range(256)) * 2)
    first.persist()
    (tmp_path / "junk.kvstate").write_bytes(b"not a state")
    for file in tmp_path.glob("*.kvstate"):
        if file.name != "junk.kvstate":
            data = bytearray(file.read_bytes())
            data[-1] ^= 0xFF  # one flipped payload byte
            file.write_bytes(data)
    restarted = HostTier(1 << 20, tmp_path, "model-a", disk_budget_bytes=1 << 20)
    match = restarted.match([*path, 1])
    assert match is not None
    assert restarted.load(match) is None
    assert restarted.entries == 0 and restarted.match([*path, 1]) is None
    assert "junk.kvstate" in caplog.text
    restarted.check_integrity()


def test_an_engine_restarted_on_the_same_folder_serves_the_prefix_from_disk(
    tmp_path: Path,
) -> None:
    def core() -> tuple[EngineCore, SavingFakeRunner]:
        return _two_slot_core(prefix_cache_ram=1 << 20, prefix_cache_dir=str(tmp_path))

    first, _ = core()
    prompt = SYSTEM + "Question four?"
    submit(first, "a", prompt, max_tokens=12)
    text = text_of(run_to_completion(first)["a"])
    first.close()  # persists the slots' content
    (tmp_path / "garbage.bin").write_bytes(b"\x00" * 100)
    second, runner = core()
    submit(second, "b", prompt, max_tokens=12)
    again = run_to_completion(second)["b"]
    assert text_of(again) == text and again[-1].num_cached_tokens == len(prompt) - 1
    stats = second.snapshot().prefix_cache
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == len(prompt) - 1
    assert stats.as_dict()["tiers"]["disk"]["states"] >= 1  # type: ignore[index]
    assert len(runner.restores) == 1
    assert_kv_consistent(second, runner)


def test_states_sharing_a_prefix_on_disk_are_indexed_apart_at_a_restart(tmp_path: Path) -> None:
    first = HostTier(1 << 20, tmp_path, "model-a", disk_budget_bytes=1 << 20)
    a, b = [*range(100), 1, 2, 3], [*range(100), 7, 8, 9, 10]
    first.save(a, lambda: _state(a))
    first.save(b, lambda: _state(b))
    assert first.persist() == 2
    restarted = HostTier(1 << 20, tmp_path, "model-a", disk_budget_bytes=1 << 20)
    assert restarted.entries == 2
    for path in (a, b):
        match = restarted.match([*path, 5])
        assert match is not None and match.length == len(path)
    assert not restarted.covers([*range(50), 99])
    restarted.check_integrity()
