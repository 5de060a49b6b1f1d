"""The prefix cache on the real SmolLM2 GGUF: KV copies between streams, and greedy output that
does not change when prompts reuse cached KV (E4 with E8)."""

from __future__ import annotations

from pathlib import Path

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.options import CacheBudget
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import greedy, run_logprobs

GRAIN = 64  # the llama.cpp runner's prefill grain: a hit leaves this much to compute

SYSTEM = (
    "You are a meticulous research assistant. "
    + " ".join(
        f"Rule {i}: answer question {i} with care, cite sources, stay brief." for i in range(24)
    )
    + "\n"
)


def test_copy_and_trim_between_streams(runner: LlamaCppRunner) -> None:
    EngineCore(runner, EngineConfig(num_slots=8))  # empties every slot
    tokens = runner.tokenizer.encode(SYSTEM)
    runner.add_sequence(0, greedy(1, logprobs=0), tokens, None)
    runner.execute([ScheduledChunk(0, tokens, 0, True)])
    runner.copy_kv(0, 3, 100)
    assert runner.kv_tokens(0) == len(tokens) and runner.kv_tokens(3) == 100
    runner.trim_kv(0, 10)
    runner.add_sequence(3, greedy(1, logprobs=0), tokens, None)
    # The copy lands before the next forward reads slot 3 (llama.cpp copies buffers lazily).
    runner.execute([ScheduledChunk(3, tokens[100:], 100, True)])
    assert runner.kv_tokens(3) == len(tokens) and runner.kv_tokens(0) == 10
    for slot in (0, 3):
        runner.remove_sequence(slot)
        runner.trim_kv(slot, 0)


def test_identical_prompts_back_to_back_hit_and_agree(runner: LlamaCppRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompt = runner.tokenizer.encode(SYSTEM + "Question: what is a prime number?")
    results = [run_logprobs(core, {f"r{i}": prompt}, 24)[f"r{i}"] for i in range(4)]
    reused = len(prompt) - GRAIN  # invariant 8: a grain is always computed
    assert [cached for _, cached in results] == [0] + [reused] * 3
    assert all(tokens == results[0][0] for tokens, _ in results)
    stats = core.snapshot().prefix_cache
    assert stats.hits >= 3 and stats.hit_tokens == 3 * reused


def test_sixteen_concurrent_prompts_sharing_a_system_prompt_match_cache_off(
    runner: LlamaCppRunner,
) -> None:
    # Half the users ask short questions (hits end on the 64-token grid), half long ones (hits
    # end where the prompts diverge, off the grid).
    prompts = {
        f"u{i}": runner.tokenizer.encode(
            SYSTEM + f"User {i}: {PROMPTS[i % 8]}" + (" Explain in detail." * 24 if i % 2 else "")
        )
        for i in range(16)
    }
    outputs = {}
    for prefix_cache in (False, True):
        core = EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=prefix_cache))
        outputs[prefix_cache] = run_logprobs(core, prompts, 24)
    off, on = outputs[False], outputs[True]
    assert {rid: t for rid, (t, _) in on.items()} == {rid: t for rid, (t, _) in off.items()}
    system_tokens = len(runner.tokenizer.encode(SYSTEM))
    # The shared system prompt was computed once: every other request reused it.
    reused = [cached >= system_tokens - GRAIN for _, cached in on.values()]
    assert sorted(reused) == [False] + [True] * 15
    assert any(cached % GRAIN for _, cached in on.values()), "no hit ended off the grid"
    assert all(cached == 0 for _, cached in off.values())


def test_fully_cached_prompt_still_computes_its_last_grain(runner: LlamaCppRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompt = runner.tokenizer.encode(SYSTEM)
    first, _ = run_logprobs(core, {"a": prompt}, 16)["a"]
    assert core.prefix_cache.enabled
    assert len(max((core.prefix_cache.held_tokens(s) for s in range(8)), key=len)) == len(prompt)
    again, cached = run_logprobs(core, {"b": prompt}, 16)["b"]
    assert cached == len(prompt) - GRAIN  # the last 64 tokens are computed as alone
    assert again == first


def test_tiny_budget_evicts_yet_outputs_stay_right(runner: LlamaCppRunner) -> None:
    # Prompts of two to three whole cells, each with its own start.
    prompts = {
        f"p{i}": runner.tokenizer.encode(p + SYSTEM[:600]) for i, p in enumerate(PROMPTS[:4])
    }
    reference = run_logprobs(
        EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=False)), prompts, 12
    )
    core = EngineCore(
        runner, EngineConfig(num_slots=2, prefix_cache_budget=CacheBudget(tokens=GRAIN))
    )
    for rid, prompt in prompts.items():
        tokens, _ = run_logprobs(core, {rid: prompt}, 12)[rid]
        assert tokens == reference[rid][0]
        assert core.snapshot().prefix_cache.evictable_tokens <= GRAIN
    assert core.snapshot().prefix_cache.evictions > 0


def test_cancel_mid_prefill_leaves_a_reusable_consistent_cache(runner: LlamaCppRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=8, max_batch_tokens=160, prefill_chunk=64))
    prompt = runner.tokenizer.encode(SYSTEM + "Tell me a story.")
    core.add_request(EngineCoreRequest("a", prompt, greedy(8, logprobs=0)))
    core.step()
    core.step()
    core.abort("a")
    core.step()
    core.check_integrity()
    # Two chunks ran: the odd part plus a grain (so whole grains are left), then a grain.
    computed = len(prompt) % GRAIN + 2 * GRAIN
    assert core.snapshot().prefix_cache.cached_tokens == computed
    tokens, cached = run_logprobs(core, {"b": prompt}, 16)["b"]
    assert cached == computed
    fresh = run_logprobs(
        EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=False)), {"c": prompt}, 16
    )
    assert tokens == fresh["c"][0]


def test_a_saved_state_restores_into_another_slot_and_computes_the_same(
    runner: LlamaCppRunner,
) -> None:
    EngineCore(runner, EngineConfig(num_slots=8))  # empties every slot
    tokens = runner.tokenizer.encode(SYSTEM)
    runner.add_sequence(0, greedy(1, logprobs=0), tokens, None)
    runner.execute([ScheduledChunk(0, tokens, 0, True)])
    state = runner.save_kv(0)
    runner.copy_kv(0, 2, 50)  # slot 0's stream is read by this copy at the next decode
    assert not runner.restore_kv(0, state), "overwriting a pending copy's source is refused"
    assert runner.kv_tokens(0) == len(tokens) and runner.kv_tokens(2) == 50
    assert runner.restore_kv(5, state) and runner.kv_tokens(5) == len(tokens)
    runner.trim_kv(5, 100)
    runner.trim_kv(0, 100)
    outputs = {}
    for slot in (5, 0):
        runner.add_sequence(slot, greedy(1, logprobs=0), tokens, None)
        outputs[slot] = runner.execute([ScheduledChunk(slot, tokens[100:], 100, True)])[slot]
    assert outputs[5] == outputs[0], "restored KV computes what the original does"
    for slot in (0, 2, 5):
        runner.remove_sequence(slot)
        runner.trim_kv(slot, 0)


def test_a_prefix_pushed_out_of_every_slot_comes_back_from_host_ram(
    runner: LlamaCppRunner,
) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=2, prefix_cache_ram=1 << 30))
    prompt = runner.tokenizer.encode(SYSTEM + "Question: what is a prime number?")
    first, _ = run_logprobs(core, {"a": prompt}, 16)["a"]
    others = {f"o{i}": runner.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:2])}
    run_logprobs(core, others, 4)  # both slots now hold other prompts
    assert all(core.prefix_cache.held_tokens(s)[:8] != prompt[:8] for s in range(2))
    again, cached = run_logprobs(core, {"b": prompt}, 16)["b"]
    assert cached == len(prompt) - GRAIN and again == first
    stats = core.snapshot().prefix_cache
    assert stats.host_hits == 1 and stats.host_hit_tokens == cached
    assert stats.host_saves >= 1 and stats.host_bytes > 0 and stats.host_restore_seconds > 0


def test_prefixes_saved_to_a_folder_serve_a_new_engine_from_disk(
    runner: LlamaCppRunner, tmp_path: Path
) -> None:
    config = EngineConfig(num_slots=2, prefix_cache_ram=1 << 30, prefix_cache_dir=str(tmp_path))
    prompt = runner.tokenizer.encode(SYSTEM + "Question: what is a square number?")
    first_core = EngineCore(runner, config)
    first, _ = run_logprobs(first_core, {"a": prompt}, 16)["a"]
    assert first_core.prefix_cache.persist() == 1  # what a graceful stop does
    core = EngineCore(runner, config)  # empties every slot: only the folder remembers
    again, cached = run_logprobs(core, {"b": prompt}, 16)["b"]
    assert cached == len(prompt) - GRAIN and again == first
    stats = core.snapshot().prefix_cache
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == cached and stats.disk_states == 1
