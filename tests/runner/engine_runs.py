"""Driving a real runner through a real engine core, for runner-level tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.images import ImageInput
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import Runner, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.options import CacheBudget
from tests.prompts import PROMPTS

NUM_TOKENS = 40


def generate(
    core: EngineCore,
    jobs: dict[str, tuple[list[int], SamplingParams]],
    start_after: dict[str, tuple[str, int]] | None = None,
    adapters: dict[str, int] | None = None,
    images: Mapping[str, Sequence[ImageInput]] | None = None,
) -> dict[str, list[int]]:
    """Runs ``jobs`` to completion; ``start_after[rid] = (other, k)`` submits ``rid`` once
    ``other`` has generated ``k`` tokens; ``adapters[rid]``: the LoRA adapter ``rid`` runs
    with; ``images[rid]``: its prompt's images. Returns each request's output token ids."""
    start_after = start_after or {}
    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    pending = dict(jobs)
    done: set[str] = set()

    def submit_ready() -> None:
        for rid in list(pending):
            gate = start_after.get(rid)
            if gate is None or len(tokens[gate[0]]) >= gate[1]:
                prompt, params = pending.pop(rid)
                adapter = (adapters or {}).get(rid, 0)
                shown = (images or {}).get(rid, ())
                core.add_request(EngineCoreRequest(rid, prompt, params, 0, adapter, tuple(shown)))

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


def alone_then_together(
    core: EngineCore,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    start_after: dict[str, tuple[str, int]] | None = None,
    images: Mapping[str, Sequence[ImageInput]] | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each prompt run by itself, one after another, then all of them at once in the same
    core (``start_after`` staggers them, as :func:`generate` does; ``images`` as there);
    requests ``p0``, ``p1``, ... Returns (alone, together)."""
    alone: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        alone.update(generate(core, {f"p{i}": (prompt, params)}, images=images))
    jobs = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    return alone, generate(core, jobs, start_after=start_after, images=images)


def greedy_alone_then_together(
    runner: Runner, tokens: int
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The first four test prompts, ``tokens`` greedy tokens each, through a fresh core of 4
    slots without the prefix cache: :func:`alone_then_together`."""
    core = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS[:4]]
    return alone_then_together(core, prompts, greedy(tokens))


def through_host_and_disk(num_slots: int, folder: Path) -> EngineConfig:
    """A prefix cache that keeps nothing in the runner's KV: a budget of 0 evicts every prefix
    as its request ends, so each goes to host RAM (1 GiB) and, below it or at a restart, to
    ``folder``."""
    return EngineConfig(
        num_slots=num_slots,
        prefix_cache_budget=CacheBudget(tokens=0),
        prefix_cache_ram=1 << 30,
        prefix_cache_dir=str(folder),
    )


def greedy(n: int = NUM_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


class Recording:
    """Delegates to a real runner and records each batch's chunk sizes."""

    def __init__(self, runner: Runner, batches: list[list[int]]) -> None:
        self._runner = runner
        self._batches = batches

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        self._batches.append([len(c.token_ids) for c in chunks])
        return self._runner.execute(chunks)


def run_logprobs(
    core: EngineCore, jobs: dict[str, list[int]], n: int
) -> dict[str, tuple[list[tuple[int, float | None]], int]]:
    """Submits all jobs at once, greedy with the chosen tokens' log-probabilities (any
    rounding difference shows there); returns each one's output (token, logprob) pairs and
    cached prompt tokens, after the engine's integrity check."""
    for rid, prompt in jobs.items():
        core.add_request(EngineCoreRequest(rid, prompt, greedy(n, logprobs=0)))
    tokens: dict[str, list[tuple[int, float | None]]] = {rid: [] for rid in jobs}
    cached: dict[str, int] = {}
    while len(cached) < len(jobs):
        for out in core.step():
            assert out.error is None, out.error
            for delta in out.deltas:
                assert delta.logprobs is not None
                tokens[out.request_id].extend((t.token_id, t.logprob) for t in delta.logprobs)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    core.check_integrity()
    return {rid: (tokens[rid], cached[rid]) for rid in jobs}


def scores(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, float]:
    """A cross-encoder's score of each prompt (a one-value pooled output), by request id."""
    for rid, prompt in prompts.items():
        core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(embed=True)))
    done: dict[str, float] = {}
    while len(done) < len(prompts):
        for out in core.step():
            if out.finished:
                assert out.error is None and out.embedding is not None, out.error
                assert len(out.embedding) == 1
                done[out.request_id] = out.embedding[0]
    return done


def adapter_ids(runner: Runner) -> list[int]:
    return [adapter.adapter_id for adapter in runner.model_info.adapters]


def check_tokens_alone_equal_tokens_beside_other_adapters(
    runner: Runner, prompts: list[list[int]], tokens: int
) -> None:
    """Six requests over the runner's two adapters and none: each one's greedy tokens are the
    same alone and all batched (prefix cache off), and the adapters change them."""
    core = EngineCore(runner, EngineConfig(num_slots=6, prefix_cache=False))
    first, second = adapter_ids(runner)
    chosen = {"a": first, "b": second, "c": 0, "d": first, "e": second, "f": 0}
    jobs = {rid: (prompts[i % 3], greedy(tokens)) for i, rid in enumerate(chosen)}
    alone: dict[str, list[int]] = {}
    for rid, job in jobs.items():
        alone |= generate(core, {rid: job}, adapters=chosen)
    together = generate(core, jobs, adapters=chosen)
    assert together == alone
    assert alone["a"] != alone["c"] != alone["b"], "adapters made no difference"


def check_prefix_cache_never_crosses_adapters(
    runner: Runner, prompt: list[int], tokens: int
) -> None:
    """A prompt computed with one adapter (or none) is never a cache hit for another, and is
    one for the same adapter; every request gets its solo tokens."""
    core = EngineCore(runner, EngineConfig(num_slots=6))
    first, second = adapter_ids(runner)
    solo = {}
    for name, adapter in (("base", 0), ("first", first), ("second", second)):
        core.flush_prefix_cache()
        solo[name] = generate(core, {name: (prompt, greedy(tokens))}, adapters={name: adapter})
    core.flush_prefix_cache()
    hits = []
    for rid, adapter in (("1", first), ("2", 0), ("3", second), ("4", first)):
        before = core.snapshot().prefix_cache.hit_tokens
        out = generate(core, {rid: (prompt, greedy(tokens))}, adapters={rid: adapter})
        hits.append(core.snapshot().prefix_cache.hit_tokens - before)
        expected = {first: "first", 0: "base", second: "second"}[adapter]
        assert out[rid] == solo[expected][expected], f"request {rid}"
    assert hits[:3] == [0, 0, 0], "a prefix computed with one adapter served another"
    assert hits[3] > 0, "the same adapter's prompt was not served from the cache"
