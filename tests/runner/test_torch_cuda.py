"""The PyTorch runner on an NVIDIA GPU: greedy parity with transformers on the same device and a
throughput smoke test. Skipped where CUDA is absent (the CI machine has none)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.pytorch.checkpoint import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import generate, greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)


def test_greedy_parity_with_transformers_on_the_gpu(hf_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = TorchRunner(
        TorchLoadConfig(hf_checkpoint, num_slots=8, dtype="float32", device="cuda")
    )
    model: Any = AutoModelForCausalLM.from_pretrained(str(hf_checkpoint), dtype=torch.float32)
    model = model.to("cuda")
    model.train(False)
    core = EngineCore(runner, EngineConfig(num_slots=8))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    ours = generate(core, {f"p{i}": (p, greedy(32)) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours[f"p{i}"] == out[0, len(prompt) :].tolist(), f"prompt {i}"
    runner.close()


def test_decode_throughput_smoke(hf_checkpoint: Path) -> None:
    runner = TorchRunner(TorchLoadConfig(hf_checkpoint, num_slots=64, device="cuda"))
    core = EngineCore(runner, EngineConfig(num_slots=64, max_batch_tokens=2048))
    prompt = runner.tokenizer.encode(PROMPTS[0])
    generate(core, {"warm": (prompt, greedy(8))})
    started = time.perf_counter()
    out = generate(core, {f"r{i}": (prompt, greedy(64)) for i in range(64)})
    rate = sum(len(t) for t in out.values()) / (time.perf_counter() - started)
    print(f"GPU: 64 sequences × 64 tokens: {rate:.0f} tok/s")
    assert rate > 500
    runner.close()
