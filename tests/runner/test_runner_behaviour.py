"""What both runners must do under the engine, on the real SmolLM2 model: batch invariance
(E4), seeded reproducibility, cancellation, stop handling, streaming deltas, and KV that is
freed when a sequence ends. Each test runs on the llama.cpp runner and the PyTorch runner."""

from __future__ import annotations

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.slots import SlotState
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import Runner
from slotserve.engine.sampling_params import SamplingParams
from tests.prompts import PROMPTS
from tests.runner.conftest import require_batch_invariance
from tests.runner.engine_runs import Recording, alone_then_together, generate, greedy


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_greedy_tokens_are_identical_alone_and_batched(
    any_runner: Runner, prefix_cache: bool
) -> None:
    require_batch_invariance(any_runner)
    # With the cache on, the batched run reuses the KV the runs alone left behind.
    core = EngineCore(any_runner, EngineConfig(num_slots=8, prefix_cache=prefix_cache))
    prompts = [any_runner.tokenizer.encode(p) for p in PROMPTS]
    alone, together = alone_then_together(core, prompts, greedy())
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) == len(PROMPTS)


def test_long_prefill_arriving_beside_a_decoding_sequence_changes_nothing(
    any_runner: Runner,
) -> None:
    """A neighbour's long prefill chunk must not change a decoding sequence (E4)."""
    require_batch_invariance(any_runner)
    batches: list[list[int]] = []
    config = EngineConfig(num_slots=8, prefix_cache=False)  # the long chunk must really run
    core = EngineCore(Recording(any_runner, batches), config)  # type: ignore[arg-type]
    encode = any_runner.tokenizer.encode
    short = encode(PROMPTS[0])
    long_text = " ".join(f"Paragraph {i}: " + PROMPTS[i % 8] + " and more." for i in range(60))
    long = encode(long_text)
    assert len(long) > 512, "the neighbour's prompt must fill a whole prefill chunk"
    alone = generate(core, {"short": (short, greedy(64))})["short"]
    long_alone = generate(core, {"long": (long, greedy(16))})["long"]
    mixed = generate(
        core,
        {"short": (short, greedy(64)), "long": (long, greedy(16))},
        start_after={"long": ("short", 8)},
    )
    assert mixed["short"] == alone
    assert mixed["long"] == long_alone
    # The case happened: one step carried a decode token and a long prefill chunk.
    assert any(1 in sizes and max(sizes) >= 256 for sizes in batches)


def test_long_context_decoding_alone_matches_decoding_beside_others(any_runner: Runner) -> None:
    """Log-probabilities, not only tokens, are compared: they show any rounding difference."""
    require_batch_invariance(any_runner)
    core = EngineCore(any_runner, EngineConfig(num_slots=8, prefix_cache=False))
    long_text = " ".join(f"Note {i}: " + PROMPTS[i % 8] + "." for i in range(24))
    prompts = [any_runner.tokenizer.encode(f"Reader {k}. " + long_text) for k in range(4)]
    assert all(300 < len(p) < 448 for p in prompts)
    params = greedy(24, logprobs=0)

    def logprobs(jobs: dict[str, list[int]]) -> dict[str, list[float | None]]:
        for rid, prompt in jobs.items():
            core.add_request(EngineCoreRequest(rid, prompt, params))
        seen: dict[str, list[float | None]] = {rid: [] for rid in jobs}
        finished: set[str] = set()
        while len(finished) < len(jobs):
            for out in core.step():
                for delta in out.deltas:
                    seen[out.request_id].extend(t.logprob for t in delta.logprobs or [])
                if out.finished:
                    finished.add(out.request_id)
        return seen

    alone = logprobs({"a": prompts[0]})["a"]
    together = logprobs({f"p{k}": p for k, p in enumerate(prompts)})["p0"]
    assert len(alone) == 24 and together == alone


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(any_runner: Runner) -> None:
    require_batch_invariance(any_runner)
    core = EngineCore(any_runner, EngineConfig(num_slots=8))
    encode = any_runner.tokenizer.encode
    prompt = encode(PROMPTS[4])
    seeded = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = generate(core, {"s": (prompt, seeded)})["s"]
    others = {
        f"o{i}": (encode(p), SamplingParams(max_tokens=32, seed=i))
        for i, p in enumerate(PROMPTS[:5])
    }
    batched = generate(core, {"s": (prompt, seeded), **others})["s"]
    assert batched == alone
    other_seed = generate(
        core, {"s": (prompt, SamplingParams(max_tokens=32, seed=99, ignore_eos=True))}
    )["s"]
    assert other_seed != alone, "a different seed should draw a different continuation"


def test_removed_sequence_leaves_no_kv_behind(any_runner: Runner) -> None:
    core = EngineCore(any_runner, EngineConfig(num_slots=8, prefix_cache=False))
    prompt = any_runner.tokenizer.encode(PROMPTS[1])
    first = generate(core, {"a": (prompt, greedy(16))})["a"]
    assert all(any_runner.kv_tokens(slot) == 0 for slot in range(8))
    assert any_runner.kv_used_tokens(range(8)) == 0
    second = generate(core, {"a": (prompt, greedy(16))})["a"]
    assert first == second, "a reused slot must start from an empty KV"


def test_abort_mid_generation_frees_the_slot_and_its_kv_in_one_step(any_runner: Runner) -> None:
    batches: list[list[int]] = []
    core = EngineCore(
        Recording(any_runner, batches),  # type: ignore[arg-type]
        EngineConfig(num_slots=8, prefix_cache=False),
    )
    prompt = any_runner.tokenizer.encode(PROMPTS[2])
    core.add_request(EngineCoreRequest("gone", prompt, greedy(200)))
    core.add_request(EngineCoreRequest("stays", prompt, greedy(12)))
    produced = 0
    while produced < 5:
        for out in core.step():
            if out.request_id == "gone":
                produced += sum(len(d.token_ids) for d in out.deltas)
    core.abort("gone")
    steps_before = len(batches)
    outputs = {o.request_id: o for o in core.step()}
    assert outputs["gone"].finished and outputs["gone"].deltas[-1].finish_reason == "abort"
    gone_slot = 0  # admitted first
    assert core.scheduler.slots.slots[gone_slot].state is SlotState.FREE
    assert any_runner.kv_tokens(gone_slot) == 0
    assert all(len(b) == 1 for b in batches[steps_before:]), "only the other request runs on"
    while core.scheduler.has_work:
        core.step()
    core.check_integrity()


def test_stop_strings_and_stop_token_ids_end_the_sequence(any_runner: Runner) -> None:
    core = EngineCore(any_runner, EngineConfig(num_slots=8))
    prompt = any_runner.tokenizer.encode(PROMPTS[5])
    free_run = generate(core, {"free": (prompt, greedy(24))})["free"]
    text = b"".join(any_runner.tokenizer.token_bytes(t) for t in free_run).decode(errors="ignore")
    word = text.split()[2]
    texts: list[str] = []
    reasons: list[object] = []
    core.add_request(
        EngineCoreRequest(
            "stopped", prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(word,))
        )
    )
    while core.scheduler.has_work or not reasons:
        for out in core.step():
            texts.extend(d.text for d in out.deltas)
            reasons.extend(d.stop_reason for d in out.deltas if d.finish_reason)
    streamed = "".join(texts)
    assert word not in streamed and text.startswith(streamed) and reasons == [word]
    stop_id = free_run[3]
    by_id = generate(
        core,
        {"id": (prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,)))},
    )["id"]
    assert by_id == free_run[: free_run.index(stop_id) + 1]


def test_streamed_deltas_add_up_to_the_whole_text(any_runner: Runner) -> None:
    core = EngineCore(any_runner, EngineConfig(num_slots=8))
    prompt = any_runner.tokenizer.encode("Le président de la République française")
    core.add_request(EngineCoreRequest("r", prompt, greedy(30)))
    deltas: list[str] = []
    tokens: list[int] = []
    while core.scheduler.has_work or not tokens:
        for out in core.step():
            for d in out.deltas:
                deltas.append(d.text)
                tokens.extend(d.token_ids)
    whole = b"".join(any_runner.tokenizer.token_bytes(t) for t in tokens).decode("utf-8")
    assert "".join(deltas) == whole and len([d for d in deltas if d]) > 5
