"""ggml's CPU backend as the llama.cpp runner reads it: the weight layouts it offers, the one
the runner picks (never ggml's AMX buffer by default: it crashes on Intel Xeon hosts), and what
the runner reports of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.llama_cpp.cpu import (
    choose_weight_layout,
    cpu_features,
    extra_buffer_types,
)
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import generate, greedy


@pytest.mark.parametrize(
    ("repack", "offered", "extra_buffers"),
    [
        ("auto", ("AMX", "CPU_REPACK"), False),
        ("auto", ("AMX",), False),
        ("auto", ("CPU_REPACK",), True),
        ("auto", (), True),
        ("on", ("AMX", "CPU_REPACK"), True),
        ("off", ("CPU_REPACK",), False),
    ],
)
def test_auto_leaves_the_extra_buffers_off_only_where_amx_is_offered(
    repack: str, offered: tuple[str, ...], extra_buffers: bool
) -> None:
    layout = choose_weight_layout(repack, offered)
    assert layout.use_extra_buffers is extra_buffers
    if repack == "auto" and not extra_buffers:
        assert "AMX" in layout.reason and "--repack on" in layout.reason


def test_an_unknown_repack_value_names_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, on, off"):
        choose_weight_layout("amx", ())


def test_the_offered_buffer_types_agree_with_the_build() -> None:
    """The registry's list (read through ctypes) against the compiled features: repacking is
    offered exactly when compiled in; AMX only when compiled in (and its permission granted)."""
    features, offered = cpu_features(), extra_buffer_types()
    assert features
    assert ("CPU_REPACK" in offered) == ("REPACK" in features)
    if "AMX" in offered:
        assert "AMX_INT8" in features
    assert set(offered) <= {"AMX", "CPU_REPACK", "KLEIDIAI", "SPACEMIT"}


def _tokens(runner: LlamaCppRunner) -> dict[str, list[int]]:
    core = EngineCore(runner, EngineConfig(num_slots=4, max_batch_tokens=256))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS[:4]]
    return generate(core, {f"p{i}": (p, greedy(8)) for i, p in enumerate(prompts)})


def test_each_layout_serves_the_same_tokens_and_says_which_it_is(model_path: Path) -> None:
    """Batched prompts (the first multi-token batch is where ggml's AMX matmul crashed) under
    the default and with the extra buffers off; both report their layout."""
    tokens = {}
    for repack in ("auto", "off"):
        runner = LlamaCppRunner(
            model_path, num_slots=4, ctx_size=4 * 512, max_batch_tokens=256, repack=repack
        )
        try:
            compute = runner.model_info.compute
            tokens[repack] = _tokens(runner)
        finally:
            runner.close()
        assert compute.cpu_features == cpu_features() and compute.batch_invariant
        state = "on" if repack == "auto" and "AMX" not in extra_buffer_types() else "off"
        assert f"extra buffer types {state}" in compute.kernels
        assert "AMX" not in compute.kernels.split("(")[0]  # never the AMX buffer by default
    assert tokens["auto"] == tokens["off"]


def test_repacked_weights_are_reported_by_their_buffer(gemma_path: Path) -> None:
    """Gemma 3's Q4_K tensors are repacked on AVX2 and wider: the load names CPU_REPACK."""
    if "CPU_REPACK" not in extra_buffer_types():
        pytest.skip("this llama.cpp build offers no CPU_REPACK buffer")
    runner = LlamaCppRunner(gemma_path, num_slots=1, ctx_size=512, max_batch_tokens=64)
    try:
        kernels = runner.model_info.compute.kernels
    finally:
        runner.close()
    assert "CPU_REPACK" in kernels.split("(")[0], kernels
