"""GGUF LoRA adapters on the llama.cpp runner (SPEC S11): greedy tokens equal llama-cpp-python's
own ``Llama(lora_path=...)``; a request's tokens are the same alone and beside requests with
other adapters or none, though llama.cpp applies adapters per context (the runner decodes each
adapter's rows in calls of their own); the prefix cache never hands one adapter's KV to
another; adapters it cannot serve are refused with the reason, the runner unharmed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slotserve.bench.lora_adapters import random_gguf_adapter
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from tests.prompts import PROMPTS
from tests.runner.conftest import FLASH_ATTN, llama_cpp_greedy, llama_cpp_reference
from tests.runner.engine_runs import (
    adapter_ids,
    check_prefix_cache_never_crosses_adapters,
    check_tokens_alone_equal_tokens_beside_other_adapters,
    generate,
    greedy,
)

TOKENS = 16


@pytest.fixture(scope="module")
def adapters(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two adapters: every projection at rank 8, and attention only at rank 4."""
    root = tmp_path_factory.mktemp("gguf-lora")
    return [
        random_gguf_adapter(model_path, root / "all.gguf", seed=1),
        random_gguf_adapter(
            model_path, root / "attention.gguf", seed=2, rank=4, targets=("attn_q", "attn_v")
        ),
    ]


@pytest.fixture(scope="module")
def lora_runner(model_path: Path, adapters: list[Path]) -> Iterator[LlamaCppRunner]:
    runner = LlamaCppRunner(
        model_path,
        num_slots=6,
        ctx_size=6 * 1024,
        max_batch_tokens=512,
        flash_attn=FLASH_ATTN,
        lora_modules=tuple((f"a{i}", str(path)) for i, path in enumerate(adapters)),
    )
    yield runner
    runner.close()


@pytest.mark.parametrize("which", [0, 1], ids=["all-modules", "attention"])
def test_greedy_tokens_equal_llama_cpp_python_with_the_adapter(
    model_path: Path, adapters: list[Path], which: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot, so that a decode is one row as the reference's is: with more slots a decode
    carries ballast rows (``batch.py``), and ggml rounds the adapter's float32 product of
    several rows otherwise than of one (the quantised base weights' product it does not)."""
    runner = LlamaCppRunner(
        model_path,
        num_slots=1,
        ctx_size=1024,
        max_batch_tokens=512,
        flash_attn=FLASH_ATTN,
        lora_modules=(("a", str(adapters[which])),),
    )
    assert runner.model_info.lora_unsupported is None
    core = EngineCore(runner, EngineConfig(num_slots=1))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS[:3]]
    jobs = {f"p{i}": (p, greedy(TOKENS)) for i, p in enumerate(prompts)}
    ours = generate(core, jobs, adapters=dict.fromkeys(jobs, adapter_ids(runner)[0]))
    assert ours != generate(core, jobs), "the adapter changed no token"
    runner.close()
    reference = llama_cpp_reference(model_path, monkeypatch, lora_path=str(adapters[which]))
    for i, prompt in enumerate(prompts):
        expected = llama_cpp_greedy(reference, prompt, TOKENS)
        assert ours[f"p{i}"] == expected, f"prompt {i} diverged from llama-cpp-python"
    reference.close()


def test_tokens_alone_equal_tokens_beside_other_adapters(lora_runner: LlamaCppRunner) -> None:
    prompts = [lora_runner.tokenizer.encode(p) for p in PROMPTS[:3]]
    check_tokens_alone_equal_tokens_beside_other_adapters(lora_runner, prompts, TOKENS)


def test_prefix_cache_never_crosses_adapters(lora_runner: LlamaCppRunner) -> None:
    prompt = lora_runner.tokenizer.encode(PROMPTS[4] * 12)  # past the 64-token cache grain
    check_prefix_cache_never_crosses_adapters(lora_runner, prompt, TOKENS)


def test_an_adapter_loads_and_unloads_at_run_time(
    lora_runner: LlamaCppRunner, model_path: Path, tmp_path: Path
) -> None:
    core = EngineCore(lora_runner, EngineConfig(num_slots=6, prefix_cache=False))
    prompt = lora_runner.tokenizer.encode(PROMPTS[0])
    extra = random_gguf_adapter(model_path, tmp_path / "extra.gguf", seed=3, rank=2)
    info = core.call_adapter("extra", str(extra))
    assert info.rank == 2 and info.adapter_id not in adapter_ids(lora_runner)
    core.add_request(EngineCoreRequest("r", prompt, greedy(TOKENS), adapter=info.adapter_id))
    core.step()
    core.call_adapter("extra", None)
    (out,) = [o for o in core.step() if o.request_id == "r"]
    assert out.finished and "unloaded" in (out.error or "")
    assert generate(core, {"after": (prompt, greedy(4))})["after"]  # the base model serves on


def _truncated(adapter: Path, tmp: Path) -> Path:
    out = tmp / "truncated.gguf"
    out.write_bytes(adapter.read_bytes()[:100])
    return out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda model, adapter, tmp: tmp / "missing.gguf", "not a .gguf file"),
        (lambda model, adapter, tmp: tmp, "not a .gguf file"),  # a PEFT folder's place
        (lambda model, adapter, tmp: model, "not a GGUF LoRA adapter"),
        (lambda model, adapter, tmp: _truncated(adapter, tmp), "not a readable GGUF"),
    ],
    ids=["missing", "folder", "a-model", "truncated"],
)
def test_adapters_it_cannot_serve_are_refused_with_the_reason(
    lora_runner: LlamaCppRunner,
    model_path: Path,
    adapters: list[Path],
    tmp_path: Path,
    make: object,
    message: str,
) -> None:
    before = list(lora_runner.adapters)
    path = make(model_path, adapters[0], tmp_path)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        lora_runner.load_adapter("bad", path)
    assert list(lora_runner.adapters) == before


def test_an_adapter_of_another_model_is_refused(
    lora_runner: LlamaCppRunner, gemma_path: Path, tmp_path: Path
) -> None:
    other = random_gguf_adapter(gemma_path, tmp_path / "gemma.gguf", seed=4)
    with pytest.raises(ValueError, match="refused the adapter"):
        lora_runner.load_adapter("gemma", other)
    big = random_gguf_adapter(gemma_path, tmp_path / "big.gguf", seed=5, rank=128)
    with pytest.raises(ValueError, match="over --max-lora-rank 64"):
        lora_runner.load_adapter("big", big)
