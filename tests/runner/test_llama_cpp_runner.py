"""The llama.cpp runner on the real SmolLM2 GGUF: fidelity to llama-cpp-python's own
single-sequence greedy decoding. (Behaviour both runners share is in test_runner_behaviour.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from tests.prompts import PROMPTS
from tests.runner.conftest import llama_cpp_greedy, llama_cpp_reference
from tests.runner.engine_runs import NUM_TOKENS, generate, greedy


def test_greedy_output_matches_llama_cpp_python_single_sequence(
    runner: LlamaCppRunner, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = llama_cpp_reference(model_path, monkeypatch)
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    ours = generate(core, {f"p{i}": (p, greedy()) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        expected = llama_cpp_greedy(reference, prompt, NUM_TOKENS)
        assert ours[f"p{i}"] == expected, f"prompt {i} diverged from llama-cpp-python"
    reference.close()
