"""A decoder's layers chained in one call of the CPU kernels (``model/layer_stack.py``): the
models it serves get the Python decoder's exact log-probabilities from it, on mixed steps of
prompt chunks and decode rows; the models and steps it does not compute keep the decoder."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.runner_interface import Runner
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import run_logprobs
from tests.runner.hf_checkpoint import tiny_random_checkpoint


@contextmanager
def _without_stack(runner: TorchRunner) -> Iterator[None]:
    """The runner on the Python decoder while it lasts."""
    model = runner.shard.model
    stack, model.stack = model.stack, None
    try:
        yield
    finally:
        model.stack = stack


def _mixed_steps(
    runner: Runner, max_batch_tokens: int = 24
) -> dict[str, tuple[list[tuple[int, float | None]], int]]:
    """Four prompts at once with their log-probabilities, in chunks of at most
    ``max_batch_tokens`` a step: the later prompts' chunks share steps with the earlier ones'
    decode rows."""
    config = EngineConfig(num_slots=4, max_batch_tokens=max_batch_tokens, prefix_cache=False)
    core = EngineCore(runner, config)
    jobs = {f"p{i}": runner.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:4])}
    return run_logprobs(core, jobs, 12)


def _assert_same_as_decoder(runner: TorchRunner) -> None:
    assert runner.shard.model.stack is not None
    chained = _mixed_steps(runner)
    with _without_stack(runner):
        assert _mixed_steps(runner) == chained


def test_the_embedded_ggufs_quantized_layers_run_chained(
    kernels: CpuKernels, torch_runner: TorchRunner
) -> None:
    _assert_same_as_decoder(torch_runner)


@pytest.mark.parametrize(
    ("family", "quantization"),
    [
        ("llama", "none"),  # the bfloat16 GEMM
        ("qwen2", "none"),  # q/k/v biases, a tied head
        ("qwen2", "Q8_0"),  # the biases beside quantized weights
        ("qwen3", "Q4_0"),  # q/k norms, 48-wide heads
        ("gemma3_text", "none"),  # sandwich norms, GELU, sliding layers with their own rotary
        ("gemma3_text", "Q8_0"),
    ],
)
def test_each_plain_familys_layers_run_chained(
    kernels: CpuKernels,
    hf_checkpoint: Path,
    tmp_path: Path,
    family: str,
    quantization: str,
) -> None:
    folder = tiny_random_checkpoint(family, hf_checkpoint, tmp_path / family)
    runner = TorchRunner(
        TorchLoadConfig(folder, num_slots=4, max_model_len=256, quantization=quantization)
    )
    try:
        _assert_same_as_decoder(runner)
    finally:
        runner.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text"])
def test_layers_the_chain_does_not_compute_keep_the_decoder(
    kernels: CpuKernels, hf_checkpoint: Path, tmp_path: Path, family: str
) -> None:
    folder = tiny_random_checkpoint(family, hf_checkpoint, tmp_path / family)
    runner = TorchRunner(TorchLoadConfig(folder, num_slots=4, max_model_len=256))
    try:
        assert runner.shard.model.stack is None
        # A hybrid model's prompt chunks come in whole grains of 64 tokens.
        assert all(tokens for tokens, _ in _mixed_steps(runner, 136).values())
    finally:
        runner.close()
