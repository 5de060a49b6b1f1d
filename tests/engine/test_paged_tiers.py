"""The host-RAM and disk tiers behind the paged prefix cache: prefixes evicted from the pool are
saved and written back into fresh blocks on a later hit. The fake runner's "KV" is the tokens
written into each block, so a state restored into the wrong blocks or positions changes the
output, and ``check`` compares every tree node's blocks with its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.prefix_cache.paged_cache import PagedPrefixCache
from slotserve.options import CacheBudget
from tests.engine.helpers import make_core, run_to_completion, submit, text_of, texts_in_waves
from tests.engine.test_host_tier import RAM_BUDGETS, SYSTEM, WAVE_REQUESTS
from tests.engine.test_paged_prefix_cache import check as check_paged
from tests.engine.test_paged_prefix_cache import solo_text
from tests.fake_runner import FakeRunner
from tests.fake_state_runners import PagedSavingFakeRunner


def _core(blocks: int = 128, **config: object) -> tuple[EngineCore, PagedSavingFakeRunner]:
    runner = PagedSavingFakeRunner(num_slots=2, max_seq_len=blocks * 4, kv_pool_blocks=blocks)
    config.setdefault("prefix_cache_ram", 1 << 20)
    core, _ = make_core(runner, **config)
    return core, runner


def _paged(core: EngineCore) -> PagedPrefixCache:
    cache = core.prefix_cache
    assert isinstance(cache, PagedPrefixCache)
    return cache


def check(core: EngineCore, runner: FakeRunner) -> None:
    """The paged cache's checks, and every cached node's blocks holding the node's own
    tokens."""
    check_paged(core, runner)
    cache, size = _paged(core), runner.kv_block_size
    for node in cache.tree.subtree(cache.tree.root):
        if node.parent is None:
            continue
        path, first = cache.tree.path_tokens(node), node.start // size
        for position in range(node.start, node.end):
            block = node.value.blocks[position // size - first]
            assert runner.block_tokens[block][position % size] == path[position], position


def _push_out(core: EngineCore) -> None:
    """Two unrelated long prompts need most of the pool: cached prefixes are evicted."""
    submit(core, "x", "x" * 200, max_tokens=4)
    submit(core, "y", "y" * 200, max_tokens=4)
    run_to_completion(core)


def _answer_then_push_out(core: EngineCore, prompt: str) -> str:
    """Runs ``prompt`` alone, then pushes it out of the pool; returns its text."""
    submit(core, "a", prompt, max_tokens=12)
    text = text_of(run_to_completion(core)["a"])
    _push_out(core)
    return text


def test_a_prefix_evicted_from_the_pool_is_written_back_from_host_ram() -> None:
    core, runner = _core()
    prompt = SYSTEM + "Question one?"
    first = _answer_then_push_out(core, prompt)
    assert _paged(core).tree.match_prefix(list(prompt.encode())).length < 10, "evicted"
    assert runner.saves, "the evicted prefix was saved first"
    submit(core, "b", prompt, max_tokens=12)
    again = run_to_completion(core)["b"]
    assert text_of(again) == first == solo_text(prompt, 12, max_seq_len=512)
    assert again[-1].num_cached_tokens == len(prompt) - 1
    assert runner.restores == [(0, len(prompt) - 1)]
    stats = core.snapshot().prefix_cache
    assert stats.host_hits == 1 and stats.host_hit_tokens == len(prompt) - 1
    assert stats.host_saves >= 1 and 0 < stats.host_bytes <= stats.host_budget_bytes
    check(core, runner)


def test_the_tree_shares_its_whole_blocks_and_the_state_supplies_the_rest() -> None:
    # The budget keeps one conversation's tail: the other's is evicted, its path saved.
    core, runner = _core(prefix_cache_budget=CacheBudget(tokens=400))
    tail_a = SYSTEM + "a" * 100
    for request_id, prompt in (("a", tail_a), ("b", SYSTEM + "b" * 100)):
        submit(core, request_id, prompt, max_tokens=4)
        run_to_completion(core)
    prompt = tail_a + " and more?"
    assert _paged(core).tree.match_prefix(list(prompt.encode())).length == len(SYSTEM)
    submit(core, "c", prompt, max_tokens=8)
    outputs = run_to_completion(core)["c"]
    assert text_of(outputs) == solo_text(prompt, 8, max_seq_len=512)
    assert outputs[-1].num_cached_tokens >= len(tail_a)
    start, end = runner.restores[-1]
    assert start == len(SYSTEM) // 4 * 4 > 0, "the tree's blocks are shared, not rewritten"
    assert end == outputs[-1].num_cached_tokens
    check(core, runner)


def test_a_refused_restore_computes_the_prompt_and_the_text_is_unchanged() -> None:
    core, runner = _core()
    prompt = SYSTEM + "Question two?"
    first = _answer_then_push_out(core, prompt)
    runner.refuse_restores = True
    submit(core, "b", prompt, max_tokens=12)
    again = run_to_completion(core)["b"]
    assert text_of(again) == first and again[-1].num_cached_tokens == 0
    assert core.snapshot().prefix_cache.host_hits == 0
    check(core, runner)


def test_flush_empties_the_tiers_and_a_runner_without_the_copy_gets_none() -> None:
    core, _ = _core()
    submit(core, "a", SYSTEM, max_tokens=4)
    run_to_completion(core)
    _push_out(core)
    assert core.snapshot().prefix_cache.host_states >= 1
    assert core.flush_prefix_cache() > 0
    stats = core.snapshot().prefix_cache
    assert (stats.host_states, stats.host_bytes, stats.cached_tokens) == (0, 0, 0)
    off, _ = _core(prefix_cache_ram=0)
    assert _paged(off).host is None
    plain, _ = make_core(FakeRunner(kv_pool_blocks=64), prefix_cache_ram=1 << 20)
    assert _paged(plain).host is None


def test_conversations_on_a_small_pool_restore_turns_and_match_no_cache() -> None:
    prefixes = [c * 150 for c in "pqr"]

    def run(prefix_cache: bool, ram: int) -> tuple[dict[str, str], list[int], list[object]]:
        core, runner = _core(
            blocks=110, prefix_cache=prefix_cache, prefix_cache_ram=ram, prefill_chunk=32
        )
        history = list(prefixes)
        texts: dict[str, str] = {}
        cached: list[int] = []
        for turn in range(4):
            for k in range(3):
                history[k] += f" turn {turn}?"
                rid = f"c{k}t{turn}"
                submit(core, rid, history[k], max_tokens=5)
                outputs = run_to_completion(core)[rid]
                texts[rid] = text_of(outputs)
                cached.append(outputs[-1].num_cached_tokens)
                history[k] += texts[rid]
                if prefix_cache:
                    check(core, runner)
        return texts, cached, list(runner.restores)

    with_host, cached, restores = run(True, 1 << 20)
    pool_only, cached_in_pool, _ = run(True, 0)
    without, _, _ = run(False, 0)
    assert with_host == pool_only == without
    assert all(c >= 150 for c in cached[3:]), "every later turn reuses its history"
    assert sum(c < 150 for c in cached_in_pool[3:]) >= 3, "the pool cannot keep all three"
    assert len(restores) >= 3


@pytest.mark.parametrize("grain", [1, 4])
@settings(max_examples=40, deadline=None)
@given(
    requests=WAVE_REQUESTS,
    blocks=st.sampled_from([90, 140]),
    ram=RAM_BUDGETS,
    refuse=st.booleans(),
)
def test_random_workloads_give_the_text_of_no_cache_whatever_the_tiers_do(
    grain: int, requests: list[tuple[str, str, int, int]], blocks: int, ram: int, refuse: bool
) -> None:
    def run(prefix_cache: bool) -> dict[str, str]:
        runner = PagedSavingFakeRunner(
            num_slots=2,
            max_seq_len=320,
            kv_pool_blocks=blocks,
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
        return texts_in_waves(core, requests, lambda: check(core, runner) if prefix_cache else None)

    assert run(True) == run(False)


def test_an_engine_restarted_on_the_same_folder_serves_the_prefix_from_disk(
    tmp_path: Path,
) -> None:
    def core() -> tuple[EngineCore, PagedSavingFakeRunner]:
        return _core(prefix_cache_dir=str(tmp_path))

    first, _ = core()
    prompt = SYSTEM + "Question four?"
    submit(first, "a", prompt, max_tokens=12)
    text = text_of(run_to_completion(first)["a"])
    first.close()  # persists the tree
    (tmp_path / "garbage.bin").write_bytes(b"\x00" * 100)
    second, runner = core()
    submit(second, "b", prompt, max_tokens=12)
    again = run_to_completion(second)["b"]
    assert text_of(again) == text and again[-1].num_cached_tokens == len(prompt) - 1
    stats = second.snapshot().prefix_cache
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == len(prompt) - 1
    assert stats.disk_bad_files == 1
    assert runner.restores == [(0, len(prompt) - 1)]
    check(second, runner)
