"""The prefix cache's host-RAM and disk tiers on the real PyTorch runner, over a bfloat16 and an
int8 KV pool: positions copied out of the paged pool and written back into other blocks compute
the same greedy tokens and log-probabilities as the cache off."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.prefix_cache.runner_kv import SavablePagedKv
from slotserve.engine.runner_interface import Runner, ScheduledChunk
from tests.runner.conftest import RUNNER_FIXTURES
from tests.runner.engine_runs import greedy, run_logprobs, through_host_and_disk
from tests.runner.test_prefix_cache_llama_cpp import SYSTEM


@pytest.fixture(params=["torch", "torch-int8-kv"])
def torch_runner(request: pytest.FixtureRequest) -> Runner:
    """The PyTorch runner over each KV pool type: this module's tests take conftest's
    ``torch_runner`` (which this one reaches by its name) and the int8 one in turn."""
    runner: Runner = request.getfixturevalue(RUNNER_FIXTURES[request.param])
    return runner


def _savable(runner: Runner) -> SavablePagedKv:
    assert isinstance(runner, SavablePagedKv)
    return runner


def test_positions_written_into_other_blocks_compute_what_the_original_does(
    torch_runner: Runner,
) -> None:
    runner = _savable(torch_runner)
    EngineCore(torch_runner, EngineConfig(num_slots=8))  # empties every slot
    paged = torch_runner.paged_kv
    assert paged is not None
    tokens = torch_runner.tokenizer.encode(SYSTEM)
    assert runner.reserve_kv(0, len(tokens))
    torch_runner.add_sequence(0, greedy(1, logprobs=0), tokens, None)
    torch_runner.execute([ScheduledChunk(0, tokens, 0, True)])
    state = runner.save_kv_blocks(paged.table(0), len(tokens))
    assert len(state) == len(tokens) * torch_runner.model_info.kv_bytes_per_token
    # Slot 1 shares slot 0's first two blocks and gets the rest from the state.
    start = 2 * paged.block_size
    paged.share(1, paged.table(0), start)
    assert runner.reserve_kv(1, 100)
    assert not runner.restore_kv_blocks(1, start, 100, state[:-1]), "not a whole state"
    assert not runner.restore_kv_blocks(1, start, len(tokens) + 1, state), "too short"
    assert runner.restore_kv_blocks(1, start, 100, state) and runner.kv_tokens(1) == 100
    assert set(paged.table(1)[2:]).isdisjoint(paged.table(0)), "written into its own blocks"
    runner.trim_kv(0, 100)
    outputs = {}
    for slot in (1, 0):
        torch_runner.add_sequence(slot, greedy(1, logprobs=0), tokens, None)
        assert runner.reserve_kv(slot, len(tokens))
        outputs[slot] = torch_runner.execute([ScheduledChunk(slot, tokens[100:], 100, True)])[slot]
    assert outputs[1] == outputs[0]
    for slot in (0, 1):
        torch_runner.remove_sequence(slot)
        runner.trim_kv(slot, 0)


def test_evicted_prefixes_come_back_from_host_ram_and_after_a_restart_from_disk(
    torch_runner: Runner, tmp_path: Path
) -> None:
    # Weights kept quantized, the cache keeps prompts only (not their replies): whole blocks of
    # prompt, and past the shared part enough of each to be worth saving on its own.
    assert torch_runner.paged_kv is not None
    block = torch_runner.paged_kv.block_size
    filler = torch_runner.tokenizer.encode(" and")[-1]
    prompts = {
        rid: tokens + [filler] * (-len(tokens) % block)
        for rid, question in (
            ("a", "Question: what is a prime?"),
            ("b", "Name three rivers of Europe, three of Asia and three of Africa, with lengths."),
        )
        for tokens in [torch_runner.tokenizer.encode(SYSTEM + question)]
    }
    off = EngineCore(torch_runner, EngineConfig(num_slots=2, prefix_cache=False))
    reference = run_logprobs(off, prompts, 24)
    # Every prefix goes to host RAM as its request ends (its reply is long enough to be worth
    # saving with it).
    config = through_host_and_disk(2, tmp_path)
    core = EngineCore(torch_runner, config)
    assert run_logprobs(core, {"a": prompts["a"]}, 24)["a"] == reference["a"]
    stats = core.snapshot().prefix_cache
    assert stats.cached_tokens == 0 and stats.host_saves == 1 and stats.host_states == 1
    reusable = {
        rid: torch_runner.model_info.chunk_policy.reusable_length(len(p) - 1, len(p))
        for rid, p in prompts.items()
    }
    again = run_logprobs(core, prompts, 24)
    for rid in prompts:
        assert again[rid][0] == reference[rid][0], rid
    assert again["a"][1] == reusable["a"], "restored from host RAM"
    assert core.snapshot().prefix_cache.host_hits == 1
    assert core.prefix_cache.persist() >= 1  # what a graceful stop does
    restarted = EngineCore(torch_runner, config)  # empties the pool: only the folder remembers
    third = run_logprobs(restarted, {"b": prompts["b"]}, 24)["b"]
    assert third == (reference["b"][0], reusable["b"])
    stats = restarted.snapshot().prefix_cache
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == reusable["b"]
