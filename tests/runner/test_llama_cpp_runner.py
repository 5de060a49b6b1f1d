"""The llama.cpp runner on the real SmolLM2 GGUF: batch invariance (E4), fidelity to
llama-cpp-python's own single-sequence greedy decoding, and seeded reproducibility."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.engine_core import EngineCore
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.llama_cpp_runner import LlamaCppRunner
from tests.prompts import PROMPTS
from tests.runner.conftest import FLASH_ATTN

NUM_TOKENS = 40


def _generate(
    core: EngineCore,
    jobs: dict[str, tuple[list[int], SamplingParams]],
    start_after: dict[str, tuple[str, int]] | None = None,
) -> dict[str, list[int]]:
    """Runs ``jobs`` to completion; ``start_after[rid] = (other, k)`` submits ``rid`` once
    ``other`` has generated ``k`` tokens. Returns each request's output token ids."""
    start_after = start_after or {}
    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    pending = dict(jobs)
    done: set[str] = set()

    def submit_ready() -> None:
        for rid in list(pending):
            gate = start_after.get(rid)
            if gate is None or len(tokens[gate[0]]) >= gate[1]:
                prompt, params = pending.pop(rid)
                core.add_request(core.make_request(rid, prompt, params))

    submit_ready()
    while len(done) < len(jobs):
        for out in core.step():
            for delta in out.deltas:
                tokens[out.request_id].extend(delta.token_ids)
            if out.finished:
                assert out.error is None, out.error
                done.add(out.request_id)
        submit_ready()
    return tokens


def _greedy(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_greedy_tokens_are_identical_alone_and_batched(
    runner: LlamaCppRunner, prefix_cache: bool
) -> None:
    # With the cache on, the batched run reuses the KV the runs alone left behind.
    core = EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=prefix_cache))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    alone = {}
    for i, prompt in enumerate(prompts):
        alone.update(_generate(core, {f"p{i}": (prompt, _greedy())}))
    together = _generate(core, {f"p{i}": (p, _greedy()) for i, p in enumerate(prompts)})
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) == len(PROMPTS)


def test_long_prefill_arriving_beside_a_decoding_sequence_changes_nothing(
    runner: LlamaCppRunner,
) -> None:
    """A neighbour's ~450-token prefill chunk must not change a decoding sequence (E4)."""
    batches: list[list[int]] = []
    config = EngineConfig(num_slots=8, prefix_cache=False)  # the long chunk must really run
    core = EngineCore(_Recording(runner, batches), config)  # type: ignore[arg-type]
    short = runner.tokenizer.encode(PROMPTS[0])
    long_text = " ".join(f"Paragraph {i}: " + PROMPTS[i % 8] + " and more." for i in range(60))
    long = runner.tokenizer.encode(long_text)
    assert len(long) > 512, "the neighbour's prompt must fill a whole prefill chunk"
    alone = _generate(core, {"short": (short, _greedy(64))})["short"]
    long_alone = _generate(core, {"long": (long, _greedy(16))})["long"]
    mixed = _generate(
        core,
        {"short": (short, _greedy(64)), "long": (long, _greedy(16))},
        start_after={"long": ("short", 8)},
    )
    assert mixed["short"] == alone
    assert mixed["long"] == long_alone
    # The case happened: one step carried a decode token and a 448-token chunk (the largest
    # whole number of 64-token cells beside it).
    assert any(1 in sizes and max(sizes) >= 448 for sizes in batches)


class _Recording:
    """Delegates to the real runner and records each batch's chunk sizes."""

    def __init__(self, runner: LlamaCppRunner, batches: list[list[int]]) -> None:
        self._runner = runner
        self._batches = batches

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, SampledToken]:
        self._batches.append([len(c.token_ids) for c in chunks])
        return self._runner.execute(chunks)


def test_greedy_output_matches_llama_cpp_python_single_sequence(
    runner: LlamaCppRunner, model_path: Path
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    reference = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=2048,
        n_batch=512,
        n_ubatch=512,
        n_threads=2,
        flash_attn=FLASH_ATTN,
        verbose=False,
    )
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    ours = _generate(core, {f"p{i}": (p, _greedy()) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        expected = []
        for token in reference.generate(prompt, temp=0.0, reset=True):
            expected.append(token)
            if len(expected) == NUM_TOKENS:
                break
        assert ours[f"p{i}"] == expected, f"prompt {i} diverged from llama-cpp-python"
    reference.close()


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(runner: LlamaCppRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompt = runner.tokenizer.encode(PROMPTS[4])
    seeded = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _generate(core, {"s": (prompt, seeded)})["s"]
    others = {
        f"o{i}": (runner.tokenizer.encode(p), SamplingParams(max_tokens=32, seed=i))
        for i, p in enumerate(PROMPTS[:5])
    }
    batched = _generate(core, {"s": (prompt, seeded), **others})["s"]
    assert batched == alone
    other_seed = _generate(
        core, {"s": (prompt, SamplingParams(max_tokens=32, seed=99, ignore_eos=True))}
    )["s"]
    assert other_seed != alone, "a different seed should draw a different continuation"


def test_removed_sequence_leaves_no_kv_behind(runner: LlamaCppRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=False))
    prompt = runner.tokenizer.encode(PROMPTS[1])
    first = _generate(core, {"a": (prompt, _greedy(16))})["a"]
    assert all(runner.kv_tokens(slot) == 0 for slot in range(8))
    second = _generate(core, {"a": (prompt, _greedy(16))})["a"]
    assert first == second, "a reused slot must start from an empty KV stream"


def test_long_context_decoding_alone_matches_decoding_beside_others(
    runner: LlamaCppRunner,
) -> None:
    """Past 256 tokens of context a lone decode could take ggml's split-KV attention path,
    which rounds differently from batched decoding; the runner keeps it off that path. The
    log-probabilities are compared, not only the tokens: they show any rounding difference."""
    core = EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=False))
    long_text = " ".join(f"Note {i}: " + PROMPTS[i % 8] + "." for i in range(24))
    prompts = [runner.tokenizer.encode(f"Reader {k}. " + long_text) for k in range(4)]
    assert all(300 < len(p) < 448 for p in prompts)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)

    def logprobs(jobs: dict[str, list[int]]) -> dict[str, list[float | None]]:
        for rid, prompt in jobs.items():
            core.add_request(core.make_request(rid, prompt, params))
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
