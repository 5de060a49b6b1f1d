"""The PyTorch runner on an NVIDIA GPU: greedy parity with transformers on the same device, the
prefix cache's host-RAM and disk tiers, Qwen3.5's state snapshots, and a throughput smoke test.

Random weights of real configurations saved by transformers, so a GPU machine needs only a
tokenizer: SmolLM2's, converted from the embedded GGUF, or the folder that
``SLOTSERVE_TEST_TOKENIZER`` names where the model package is not installed. Skipped where CUDA
is absent (the CI machine has none)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.bench.model_shapes import SMOLLM2_135M
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import (
    alone_then_together,
    generate,
    greedy,
    run_logprobs,
    through_host_and_disk,
)
from tests.runner.hf_checkpoint import tiny_random_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)

SYSTEM = " ".join(PROMPTS * 2)  # ~110 tokens shared by every prompt
KV_MEMORY = 1 << 30  # each runner's pool: a few at once must fit beside each other


@pytest.fixture(scope="module")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    folder = os.environ.get("SLOTSERVE_TEST_TOKENIZER")
    if folder:
        return Path(folder)
    checkpoint: Path = request.getfixturevalue("hf_checkpoint")
    return checkpoint


@pytest.fixture(scope="module")
def smollm2(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's configuration with random weights."""
    out = tmp_path_factory.mktemp("smollm2-135m")
    return tiny_random_checkpoint("llama", tokenizer_dir, out, **SMOLLM2_135M)


@pytest.fixture(scope="module")
def gpu_runner(smollm2: Path) -> Iterator[TorchRunner]:
    runner = TorchRunner(
        TorchLoadConfig(
            smollm2, num_slots=2, max_model_len=2048, device="cuda", kv_memory=KV_MEMORY
        )
    )
    yield runner
    runner.close()


def hf_greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    """transformers' own greedy tokens on the GPU, exactly ``tokens`` of them."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize(
    ("attention", "eager"),
    [("torch", True), ("triton", True), ("triton", False)],
    ids=["torch", "triton-eager", "triton-graphs"],
)
def test_greedy_parity_with_transformers_on_the_gpu(
    smollm2: Path, attention: str, eager: bool
) -> None:
    from transformers import AutoModelForCausalLM

    load = TorchLoadConfig(
        smollm2,
        num_slots=8,
        dtype="float32",
        device="cuda",
        kv_memory=KV_MEMORY,
        attention_backend=attention,
        enforce_eager=eager,
    )
    runner = TorchRunner(load)
    assert (runner.shard.graphs is not None) == (not eager)
    assert ("CUDA graphs" in runner.model_info.compute.kernels) == (not eager)
    model: Any = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    model = model.to("cuda")
    model.train(False)
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    ours = generate(core, {f"p{i}": (p, greedy(32)) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert ours[f"p{i}"] == hf_greedy(model, prompt, 32), f"prompt {i}"
    runner.close()


def test_lora_adapters_match_transformers_with_peft_on_the_gpu(
    smollm2: Path, tmp_path: Path
) -> None:
    """Requests with an adapter and without one in the same steps, on the GPU's torch path
    (``model/lora.py``): each one's greedy tokens are transformers + PEFT's."""
    from transformers import AutoModelForCausalLM

    from slotserve.bench.lora_adapters import peft_model, random_adapter

    adapter = random_adapter(smollm2, tmp_path / "adapter", seed=1)
    load = TorchLoadConfig(
        smollm2,
        num_slots=8,
        dtype="float32",
        device="cuda",
        kv_memory=KV_MEMORY,
        lora_modules=(("a", str(adapter)),),
    )
    runner = TorchRunner(load)
    (info,) = runner.model_info.adapters
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS[:4]]
    jobs = {f"{kind}{i}": (p, greedy(16)) for i, p in enumerate(prompts) for kind in "ab"}
    chosen = {rid: info.adapter_id for rid in jobs if rid.startswith("a")}
    ours = generate(core, jobs, adapters=chosen)
    runner.close()
    base: Any = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    for kind, model in (("a", peft_model(smollm2, adapter)), ("b", base)):
        model.to("cuda")
        for i, prompt in enumerate(prompts):
            assert ours[f"{kind}{i}"] == hf_greedy(model, prompt, 16), f"{kind}{i}"
    assert ours["a0"] != ours["b0"], "the adapter changed no token"


def alone_and_batched(smollm2: Path, eager: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--batch-invariant`` greedy tokens of each sequence alone, then of sixteen at once with
    staggered starts."""
    load = TorchLoadConfig(
        smollm2,
        num_slots=16,
        device="cuda",
        kv_memory=KV_MEMORY,
        batch_invariant=True,
        enforce_eager=eager,
    )
    runner = TorchRunner(load)
    assert runner.model_info.compute.batch_invariant
    assert (runner.shard.graphs is None) == eager
    core = EngineCore(runner, EngineConfig(num_slots=16, prefix_cache=False))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS * 2]
    staggered = {f"p{i}": ("p0", i) for i in range(1, len(prompts))}
    runs = alone_then_together(core, prompts, greedy(24), staggered)
    runner.close()
    return runs


def test_batch_invariant_tokens_are_the_same_alone_batched_and_graphed_on_the_gpu(
    smollm2: Path,
) -> None:
    """``--batch-invariant`` in bfloat16 (Triton attention and matmuls): a sequence's tokens
    alone and batched are the same, with decode replayed from CUDA graphs (buckets 1 to 16,
    ballast rows beside the real ones) and run eagerly, and the two agree."""
    graphed = alone_and_batched(smollm2, eager=False)
    eager = alone_and_batched(smollm2, eager=True)
    assert graphed[1] == graphed[0]
    assert eager[1] == eager[0]
    assert graphed == eager


def test_host_ram_and_disk_restore_what_a_hit_in_gpu_memory_reads(
    gpu_runner: TorchRunner, tmp_path: Path
) -> None:
    """Positions copied from the GPU pool to host RAM, to disk and back are the same bits: a
    hit from either tier computes the tokens and log-probabilities of a hit in the pool. (On
    a GPU, a hit against the cache off is no promise: SDPA's kernels differ by query count.)"""
    runner = gpu_runner
    prompt = runner.tokenizer.encode(SYSTEM + " Question: what is a prime?")
    reusable = runner.model_info.chunk_policy.reusable_length(len(prompt) - 1, len(prompt))
    pool = EngineCore(runner, EngineConfig(num_slots=2))
    cold = run_logprobs(pool, {"a": prompt}, 24)["a"]
    from_pool = run_logprobs(pool, {"a": prompt}, 24)["a"]
    assert cold[1] == 0 and from_pool[1] == reusable
    config = through_host_and_disk(2, tmp_path)
    core = EngineCore(runner, config)
    assert run_logprobs(core, {"a": prompt}, 24)["a"] == cold
    assert core.snapshot().prefix_cache.host_saves == 1
    assert run_logprobs(core, {"a": prompt}, 24)["a"] == from_pool
    assert core.snapshot().prefix_cache.host_hits == 1
    assert core.prefix_cache.persist() >= 1  # what a graceful stop does
    restarted = EngineCore(runner, config)  # empties the pool: only the folder remembers
    assert run_logprobs(restarted, {"a": prompt}, 24)["a"] == from_pool
    stats = restarted.snapshot().prefix_cache
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == reusable
    pairs = list(zip(cold[0], from_pool[0], strict=True))
    matching = sum(a[0] == b[0] for a, b in pairs)
    drift = max(abs((a[1] or 0.0) - (b[1] or 0.0)) for a, b in pairs)
    print(f"GPU: a pool hit against the cold run: {matching}/24 tokens, logprobs within {drift}")


def test_qwen35_resumes_from_state_snapshots_on_the_gpu(
    tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Turns of two conversations over one system prompt: the cache hits resume from saved
    Gated DeltaNet states on the device, and the cache's books balance after every turn."""
    out = tmp_path_factory.mktemp("qwen35")
    folder = tiny_random_checkpoint("qwen3_5_text", tokenizer_dir, out)
    load = TorchLoadConfig(
        folder,
        num_slots=4,
        max_model_len=1024,
        prefix_cache_snapshots=3,
        device="cuda",
        kv_memory=KV_MEMORY,
    )
    runner = TorchRunner(load)
    encode = runner.tokenizer.encode
    cores = {
        "off": EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False)),
        "on": EngineCore(
            runner,
            EngineConfig(num_slots=4, prefill_chunk=128, prefix_cache_snapshot_interval=64),
        ),
    }
    replies: dict[str, list[Any]] = {}
    for name, core in cores.items():
        history = {c: encode(SYSTEM + SYSTEM) for c in range(2)}
        for turn in range(3):
            for c in range(2):
                history[c] = history[c] + encode(f" User {c}: {PROMPTS[(c + turn) % 4]}")
            answered = run_logprobs(core, {f"c{c}": history[c] for c in range(2)}, 6)
            for c in range(2):
                reply = answered[f"c{c}"][0]
                replies.setdefault(name, []).append(reply)
                history[c] = history[c] + [token for token, _ in reply]
    stats = cores["on"].prefix_cache.stats()
    assert stats.hits >= 4 and stats.snapshot_saves >= 3
    cores["on"].prefix_cache.flush()
    cores["on"].check_integrity()
    same = sum(
        [t for t, _ in a] == [t for t, _ in b]
        for a, b in zip(replies["on"], replies["off"], strict=True)
    )
    print(f"GPU, Qwen3.5: {same}/{len(replies['on'])} replies equal to the cache off")
    runner.close()


@pytest.mark.parametrize(
    ("attention", "eager"),
    [("torch", True), ("triton", True), ("triton", False)],
    ids=["torch", "triton-eager", "triton-graphs"],
)
def test_decode_throughput_smoke(smollm2: Path, attention: str, eager: bool) -> None:
    load = TorchLoadConfig(
        smollm2,
        num_slots=64,
        device="cuda",
        kv_memory=8 * KV_MEMORY,
        attention_backend=attention,
        enforce_eager=eager,
    )
    runner = TorchRunner(load)
    core = EngineCore(runner, EngineConfig(num_slots=64, max_batch_tokens=2048))
    prompt = runner.tokenizer.encode(PROMPTS[0])
    generate(core, {"warm": (prompt, greedy(8))})
    started = time.perf_counter()
    out = generate(core, {f"r{i}": (prompt, greedy(64)) for i in range(64)})
    rate = sum(len(t) for t in out.values()) / (time.perf_counter() - started)
    print(f"GPU, {attention} attention, eager {eager}: 64 sequences × 64 tokens: {rate:.0f} tok/s")
    assert rate > 500
    runner.close()
