"""The prefix cache on Qwen3.5 (Gated DeltaNet layers) through recurrent-state snapshots: a
hit resumes from a saved state, and every token and log-probability equals what the same
runner computes with the cache off, whatever the order of hits, snapshot reuse and
eviction. Both runners: the PyTorch runner (bfloat16 on CPU, its batch-invariant mode) on
the HF folder, llama.cpp on the same model as a Q8_0 GGUF (per-slot streams, snapshots in
host memory)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import Runner
from slotserve.engine.sampling_params import SamplingParams
from slotserve.options import CacheBudget
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.deltanet import BLOCK
from slotserve.runners.pytorch.runner import TorchRunner
from tests.conftest import start_server, stop_server
from tests.prompts import PROMPTS
from tests.runner.hf_checkpoint import q8_0_gguf, qwen35_gguf, tiny_random_checkpoint

SYSTEM = " ".join(PROMPTS * 2)  # ~110 tokens shared by every conversation
Reply = list[tuple[int, float | None]]  # (token, its log-probability)


@dataclass(frozen=True)
class Model:
    runner: str  # "torch" or "llama.cpp"
    path: Path  # the HF folder, or the GGUF


@pytest.fixture(scope="module")
def folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen35-cache")
    # Value heads as wide as key heads, as every Qwen3.5 has them and llama.cpp needs.
    return tiny_random_checkpoint(
        "qwen3_5_moe_text", hf_checkpoint, root / "moe", linear_value_head_dim=32
    )


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def model(request: pytest.FixtureRequest, folder: Path, model_path: Path) -> Model:
    if request.param == "torch":
        return Model("torch", folder)
    gguf = qwen35_gguf(folder, folder.parent / "qwen35moe-f32.gguf", model_path)
    return Model("llama.cpp", q8_0_gguf(gguf, folder.parent / "qwen35moe-q8_0.gguf"))


def _runner(model: Model, snapshots: int, num_slots: int = 4) -> Runner:
    if model.runner == "llama.cpp":
        return LlamaCppRunner(
            model.path,
            num_slots=num_slots,
            ctx_size=num_slots * 1024,
            max_batch_tokens=512,
            state_snapshots=snapshots,
        )
    load = TorchLoadConfig(
        model.path, num_slots=num_slots, max_model_len=1024, prefix_cache_snapshots=snapshots
    )
    return TorchRunner(load)


@pytest.fixture(scope="module")
def runner(model: Model) -> Iterator[Runner]:
    runner = _runner(model, snapshots=3)
    yield runner
    runner.close()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


def _run(core: EngineCore, jobs: dict[str, list[int]], max_tokens: int = 6) -> dict[str, Reply]:
    """Runs ``jobs`` together to completion, checking the cache's books after every step."""
    replies: dict[str, Reply] = {rid: [] for rid in jobs}
    for rid, prompt in jobs.items():
        core.add_request(EngineCoreRequest(rid, prompt, _params(max_tokens)))
    while core.scheduler.has_work:
        for out in core.step():
            assert out.error is None, out.error
            for delta in out.deltas:
                replies[out.request_id] += [(t.token_id, t.logprob) for t in delta.logprobs or []]
        core.check_integrity()
    return replies


def _conversations(rng: random.Random) -> list[list[str]]:
    """Turns of four conversations over one system prompt, as text (each turn's prompt is
    the previous turn's prompt, its reply and a new message, built when run)."""
    return [[f" User {c}: {rng.choice(PROMPTS)}" for _ in range(3)] for c in range(4)]


def _play(core: EngineCore, runner: Runner, seed: int) -> dict[str, Reply]:
    """Three turns of four conversations, the conversations of a turn run together (in a
    shuffled order), each turn resending the conversation so far."""
    rng = random.Random(seed)
    encode = runner.tokenizer.encode
    turns = _conversations(rng)
    history = {c: encode(SYSTEM) for c in range(4)}
    replies: dict[str, Reply] = {}
    for turn in range(3):
        order = list(range(4))
        rng.shuffle(order)
        jobs = {}
        for c in order:
            history[c] = history[c] + encode(turns[c][turn])
            jobs[f"c{c}t{turn}"] = history[c]
        answered = _run(core, jobs)
        replies.update(answered)
        for c in order:
            history[c] = history[c] + [token for token, _ in answered[f"c{c}t{turn}"]]
    return replies


def test_the_chunk_grid_is_anchored_at_position_zero(model: Model, runner: Runner) -> None:
    policy = runner.model_info.chunk_policy
    # llama.cpp computes a chunk's last odd part as a chunk of its own computes it only
    # when it is one (its attention path depends on the query count), and wants the step's
    # chunks of one length.
    on_llama_cpp = model.runner == "llama.cpp"
    alike = {"equal_chunks": True, "odd_part_alone": True} if on_llama_cpp else {}
    assert policy == ChunkPolicy(grain=BLOCK, anchored=True, **alike)
    assert runner.model_info.prefix_cache_unsupported is None
    assert policy.chunk_size(200, 150, 512) == 128  # whole grains while more is left
    # The last chunk takes the odd part (on llama.cpp, after the grains before it).
    assert policy.chunk_size(70, 512, 512) == (BLOCK if on_llama_cpp else 70)
    assert policy.chunk_size(6, 512, 512) == 6
    assert policy.reusable_length(150, 300) == 128
    assert policy.reusable_length(500, 129) == 128  # never the last prompt token
    assert policy.cacheable_length(200, 150) == 128
    assert policy.cacheable_length(100, 180) == 64  # decoded tokens are never handed out


@pytest.mark.parametrize("seed", [0, 1])
def test_conversations_equal_the_cache_off_with_few_snapshots(runner: Runner, seed: int) -> None:
    """Three snapshot places for four conversations: places are taken back and nodes
    evicted while hits resume from the rest; no token or log-probability moves."""
    off = _play(EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False)), runner, seed)
    config = EngineConfig(
        num_slots=4, max_batch_tokens=160, prefill_chunk=128, prefix_cache_snapshot_interval=64
    )
    core = EngineCore(runner, config)
    on = _play(core, runner, seed)
    assert on == off
    stats = core.prefix_cache.stats()
    assert stats.hits > 0 and stats.hit_tokens >= 3 * BLOCK
    # Places were reused: taken back from cached nodes, or freed when a slot's cached
    # conversation gave way (llama.cpp's per-slot streams keep a node only while a slot does).
    assert stats.snapshot_capacity == 3 and stats.snapshot_saves > 3
    core.prefix_cache.flush()
    core.check_integrity()


def test_a_repeated_prompt_resumes_from_its_last_grain(model: Model) -> None:
    """The same prompt again (and one token longer, a prompt ending one past the grid) hits
    at its last multiple of the grain, with the tokens of a cold run."""
    runner = _runner(model, snapshots=8)
    prompt = runner.tokenizer.encode(SYSTEM + " " + SYSTEM)
    prompt = prompt[: 3 * BLOCK + 1]  # the last chunk is one token
    cold = _run(EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False)), {"a": prompt})
    core = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache_snapshot_interval=64))
    assert _run(core, {"a": prompt}) == cold
    assert core.prefix_cache.stats().hits == 0
    assert _run(core, {"a": prompt}) == cold
    stats = core.prefix_cache.stats()
    assert stats.hits == 1 and stats.hit_tokens == 3 * BLOCK
    # Snapshots at 64, 128 and 192 (the interval and the prompt's last grain).
    assert stats.snapshots == 3 and stats.snapshot_saves == 3
    runner.close()


def test_a_branch_point_is_kept_for_the_next_prompt_sharing_it(model: Model) -> None:
    """Prompts sharing 148 tokens, each far longer, no interval: the first keeps only its
    end; the second finds no state within the shared part but keeps the one where it leaves
    the first's path (128), so the third resumes there."""
    runner = _runner(model, snapshots=8)
    encode = runner.tokenizer.encode
    shared = encode(SYSTEM + " " + SYSTEM)[: 2 * BLOCK + 20]
    tails = [
        encode(f" Question {i}: " + " ".join((PROMPTS[i:] + PROMPTS[:i]) * 2)) for i in range(3)
    ]
    assert all(len(tail) > BLOCK for tail in tails)
    prompts = [shared + tail for tail in tails]
    # One core at a time on a runner: llama.cpp's free slots keep the cache's KV.
    off = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False))
    expected = [_run(off, {str(i): prompt}) for i, prompt in enumerate(prompts)]
    config = EngineConfig(num_slots=4, prefix_cache_snapshot_interval=4096)
    core = EngineCore(runner, config)
    for i, prompt in enumerate(prompts):
        assert _run(core, {str(i): prompt}) == expected[i]
    stats = core.prefix_cache.stats()
    assert stats.hits == 1 and stats.hit_tokens == 2 * BLOCK  # the third prompt's
    assert stats.snapshot_saves == 4  # three ends and one branch point
    runner.close()


def test_no_snapshots_no_prefix_cache(model: Model) -> None:
    runner = _runner(model, snapshots=0)
    assert "--prefix-cache-snapshots is 0" in (runner.model_info.prefix_cache_unsupported or "")
    assert not EngineCore(runner, EngineConfig(num_slots=4)).prefix_cache.enabled
    runner.close()


def test_served_with_snapshots_and_the_same_text(model: Model, tmp_path: Path) -> None:
    """The server on the real ``openai`` client: a repeated conversation is a hit in
    ``/v1/prefix_cache_stats`` and gets the text it got cold."""
    server = start_server(
        tmp_path,
        str(model.path),
        "--runner",
        model.runner,
        "--slots",
        "2",
        *(("--ctx-size", "2048") if model.runner == "llama.cpp" else ("--max-model-len", "1024")),
    )
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPTS[1]},
        ]
        texts = [
            client.chat.completions.create(
                model=model.path.stem,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
            )
            .choices[0]
            .message.content
            for _ in range(2)
        ]
        stats = client.get("/prefix_cache_stats", cast_to=object)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    finally:
        stop_server(server)
    assert texts[0] == texts[1]
    assert isinstance(stats, dict) and stats["enabled"] and stats["hits"] == 1
    snapshots = stats["tiers"]["state_snapshots"]
    assert snapshots["capacity"] == 8 and snapshots["snapshots"] >= 1
    assert snapshots["bytes"] == snapshots["snapshots"] * snapshots["bytes_each"] > 0
    kept = f'slotserve:prefix_cache_state_snapshots{{model_name="{model.path.stem}"}} '
    assert f"{kept}{float(snapshots['snapshots'])}" in metrics


def test_many_orders_equal_the_cache_off(runner: Runner) -> None:
    """Prompts drawn from a few shared stems, run in random groups: hits, branch points,
    places taken back and eviction interleave; every reply equals the cache off."""
    encode = runner.tokenizer.encode
    stems = [encode(SYSTEM)[:n] for n in (70, 130, 200)]
    rng = random.Random(7)
    prompts = [
        rng.choice(stems) + encode(" " + " ".join(rng.sample(PROMPTS, 2)))[: rng.randint(1, 90)]
        for _ in range(12)
    ]
    off = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False))
    on = EngineCore(
        runner,
        EngineConfig(
            num_slots=4,
            max_batch_tokens=200,
            prefill_chunk=128,
            prefix_cache_snapshot_interval=64,
            prefix_cache_budget=CacheBudget(tokens=400),
        ),
    )
    expected = {str(i): _run(off, {str(i): p}, 3)[str(i)] for i, p in enumerate(prompts)}
    ids = list(expected)
    order = rng.sample(ids, len(ids))
    for group in (order[i : i + 3] for i in range(0, len(order), 3)):
        got = _run(on, {i: prompts[int(i)] for i in group}, 3)
        assert got == {i: expected[i] for i in group}
    stats = on.prefix_cache.stats()
    assert stats.hits > 0
    if isinstance(runner, LlamaCppRunner):  # its free slots' prefixes gave way to the budget
        assert stats.evictions > 0


def test_prompts_arriving_together_resume_where_they_branch(model: Model) -> None:
    """Three prompts sharing 200 tokens sent at once: the first computes them while the
    others wait, and the scheduler has the state kept where they will resume (192); no
    interval point or prompt end falls there."""
    runner = _runner(model, snapshots=8)
    encode = runner.tokenizer.encode
    shared = encode(SYSTEM + " " + SYSTEM)[:200]
    jobs = {
        str(i): shared + encode(f" Question {i}: " + " ".join((PROMPTS[i:] + PROMPTS[:i]) * 2))
        for i in range(3)
    }
    off = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False))
    expected = _run(off, jobs)
    config = EngineConfig(
        num_slots=4, prefix_cache_snapshot_interval=4096, prefix_wait_min_tokens=64
    )
    core = EngineCore(runner, config)
    assert _run(core, jobs) == expected
    stats = core.prefix_cache.stats()
    assert stats.hits == 2 and stats.hit_tokens == 2 * 3 * BLOCK
    runner.close()


def test_a_lone_decode_borrows_a_cached_slot_and_leaves_its_state(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp: a sequence decoding alone past 256 tokens of context takes a throw-away
    token of a neighbouring slot (``LlamaCppRunner._ballast_for``). When that slot keeps a
    cached prefix, its recurrent state, which a trim cannot undo, is put back: the prefix
    is still a hit with a cold run's tokens."""
    if model.runner != "llama.cpp":
        pytest.skip("the ballast token is the llama.cpp runner's")
    runner = _runner(model, snapshots=8, num_slots=2)
    assert isinstance(runner, LlamaCppRunner)
    encode = runner.tokenizer.encode
    cached = encode(SYSTEM + " " + SYSTEM)[:200]
    lone = encode(" ".join(reversed(PROMPTS * 6)))[:300]
    off = EngineCore(runner, EngineConfig(num_slots=2, prefix_cache=False))
    expected = [_run(off, {"a": cached}), _run(off, {"b": lone}), _run(off, {"a": cached})]
    borrowed: list[tuple[int, int]] = []
    ballast_for = runner._ballast_for

    def spy(group: list[Any]) -> list[Any]:
        ballast = ballast_for(group)
        borrowed.extend((extra.slot, extra.start_pos) for extra in ballast)
        return ballast

    monkeypatch.setattr(runner, "_ballast_for", spy)
    core = EngineCore(runner, EngineConfig(num_slots=2))
    got = [_run(core, {"a": cached}), _run(core, {"b": lone}), _run(core, {"a": cached})]
    assert got == expected
    assert (0, 3 * BLOCK) in borrowed  # slot 0 kept "a" up to 192 while "b" decoded alone
    stats = core.prefix_cache.stats()
    assert stats.hits == 1 and stats.hit_tokens == 3 * BLOCK
    runner.close()
