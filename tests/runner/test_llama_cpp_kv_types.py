"""llama-server's ``--cache-type-k`` / ``--cache-type-v`` on the llama.cpp runner: a q8_0 cache
gives llama-cpp-python's own greedy tokens under the same types, in 17/32 of f16's bytes, as the
model's info and the memory pre-flight count them; a quantized value cache without flash
attention, or the flags on the PyTorch runner, are refused before any load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slotserve.cli import build_parser
from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import RunnerConfig
from slotserve.hosting.launch import runner_factory
from slotserve.options import configure
from slotserve.runners.llama_cpp.frontend import estimate_memory


def _spec(model: Path, *argv: str) -> Any:
    namespace = build_parser().parse_args(["serve", *argv])
    return runner_factory(configure(RunnerConfig, namespace), EngineConfig(), model, "m")


def test_a_q8_0_cache_gives_llama_cpp_pythons_tokens_in_fewer_bytes(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llama_cpp

    from slotserve.engine.core.engine_core import EngineCore
    from slotserve.runners.llama_cpp.runner import LlamaCppRunner
    from tests.runner.conftest import llama_cpp_greedy, llama_cpp_reference
    from tests.runner.engine_runs import generate, greedy

    q8 = llama_cpp.GGML_TYPE_Q8_0
    reference = llama_cpp_reference(model_path, monkeypatch, type_k=q8, type_v=q8)
    runner = LlamaCppRunner(model_path, 1, 2048, 512, n_threads=2, kv_types=("q8_0", "q8_0"))
    try:
        prompt = runner.tokenizer.encode("Write three rules for a tidy kitchen.")
        ours = generate(EngineCore(runner, EngineConfig(num_slots=1)), {"p": (prompt, greedy())})
        assert ours["p"] == llama_cpp_greedy(reference, prompt, len(ours["p"]))
        f16 = estimate_memory(model_path, 1, 2048, 512).kv_bytes // 2048
        assert runner.model_info.kv_bytes_per_token * 32 == f16 * 17
    finally:
        runner.close()
        reference.close()


def test_the_pre_flight_counts_the_cache_in_its_types(model_path: Path) -> None:
    def kv(key: str, value: str) -> int:
        return estimate_memory(model_path, 4, 8192, 512, 0, (key, value)).kv_bytes

    assert kv("q4_0", "q4_0") * 32 == kv("f16", "f16") * 9
    assert kv("f32", "f16") * 2 == kv("f16", "f16") * 3
    argv = ("--runner", "llama.cpp", "-c", "8192", "-ctk", "q8_0", "-ctv", "q8_0")
    spec = _spec(model_path, *argv)
    assert spec.memory_needed().kv_bytes == kv("q8_0", "q8_0")


def test_every_type_offered_has_its_ggml_type_and_block_size() -> None:
    from slotserve.runners.llama_cpp.backend import KV_GGML_TYPES
    from slotserve.runners.llama_cpp.metadata import KV_TYPE_BLOCKS
    from slotserve.runners.options import KV_CACHE_TYPES

    assert set(KV_CACHE_TYPES) == set(KV_GGML_TYPES) == set(KV_TYPE_BLOCKS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--runner", "llama.cpp", "-ctv", "q4_0", "--no-flash-attn"), "only with flash attention"),
        (("--runner", "torch", "-ctk", "q8_0"), "--cache-type-k: a llama.cpp runner setting"),
    ],
)
def test_what_cannot_be_served_is_refused_before_any_load(
    model_path: Path, argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(model_path, *argv)
