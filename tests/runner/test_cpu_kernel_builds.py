"""The PyTorch runner's C++ CPU kernels as loaded and served: the runner serves through them
unless told not to, their GEMM serves the projections on every CPU they run on (oneDNN beside
them where they serve none), a failed build warns once and leaves the torch path, a build lock
left by a killed build does not hang the next load, and torch held to AVX2 holds them there."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotserve.engine.runner_interface import Runner
from slotserve.runners.pytorch.cpu_kernels import (
    CpuKernels,
    build_directory,
    cpu_features,
    load_cpu_kernels,
)
from slotserve.runners.pytorch.runner import TorchRunner
from tests.runner.engine_runs import greedy_alone_then_together


def test_the_runner_serves_through_the_kernels_unless_told_not_to(
    kernels: CpuKernels, torch_runner: Runner, torch_reference_runner: Runner
) -> None:
    assert isinstance(torch_runner, TorchRunner)
    assert isinstance(torch_reference_runner, TorchRunner)
    assert torch_runner.shard.model.kernels is not None
    assert torch_reference_runner.shard.model.kernels is None
    # The projections: the kernels' quantized GEMM on the GGUF's own blocks, on every CPU
    # they run on (their bfloat16 GEMM: ``test_without_a_gemm_of_ours...`` and test_cpu_gemm).
    assert kernels.has_gemm and torch_runner.shard.model.lm_head.quant_parts is not None
    assert torch_reference_runner.shard.model.lm_head.quant_parts is None
    assert torch_reference_runner.shard.model.lm_head.kernel_weight is None
    # What /v1/models says of each: the kernel path is always batch-invariant; the plain-torch
    # one states none where oneDNN has AMX kernels to choose by shape.
    served, reference = torch_runner.model_info.compute, torch_reference_runner.model_info.compute
    assert served.batch_invariant and served.kernels.startswith(
        f"slotserve CPU kernels ({kernels.isa})"
    )
    assert (kernels.gemm in served.kernels) == kernels.has_gemm
    assert reference.kernels.startswith("torch ops")
    assert reference.batch_invariant == ("AMX_BF16" not in cpu_features())


def test_without_a_gemm_of_ours_onednn_serves_the_projections_beside_the_kernels(
    kernels: CpuKernels, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels that serve no GEMM (simulated): oneDNN's prepacked, split-K projections serve
    beside the attention and per-row kernels where oneDNN has bfloat16 kernels for this CPU
    (torch's own matmul elsewhere), and every sequence keeps its tokens in a batch."""
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig
    from slotserve.runners.pytorch.model.layers import onednn_bf16

    monkeypatch.setattr(kernels, "has_gemm", False)
    runner = TorchRunner(
        TorchLoadConfig(model_path, num_slots=4, max_model_len=512, quantization="none")
    )
    try:
        model = runner.shard.model
        assert model.kernels is kernels
        assert model.lm_head.kernel_weight is None
        assert (model.lm_head.packed is not None) == onednn_bf16()
        alone, together = greedy_alone_then_together(runner, 12)
        assert together == alone
    finally:
        runner.close()


def test_a_failed_build_warns_once_and_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A machine without a compiler (simulated: the build raises as torch's does)."""
    from torch.utils import cpp_extension

    def no_compiler(**kwargs: object) -> None:
        raise RuntimeError("Error building extension 'x': c++: not found\nninja: build stopped")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert load_cpu_kernels() is None
            assert load_cpu_kernels() is None  # asked again: no second build, no second warning
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "c++: not found" in warnings[0], warnings
    finally:
        load_cpu_kernels.cache_clear()


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(
    kernels: CpuKernels,
) -> None:
    """torch's build lock is a plain file; a build killed mid-way leaves it behind. A fresh
    process must still load the kernels (bounded here by a timeout, not left to hang)."""
    stale = build_directory() / "lock"
    stale.write_text("")
    load = "from slotserve.runners.pytorch.cpu_kernels import load_cpu_kernels as f; assert f()"
    done = subprocess.run([sys.executable, "-c", load], timeout=300, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert not stale.exists()


def test_torch_held_to_avx2_holds_the_kernels_there_too(kernels: CpuKernels) -> None:
    """``ATEN_CPU_CAPABILITY=avx2`` (torch's switch) loads the kernels' AVX2 code and GEMM: an
    AVX2-only CPU's, on this one."""
    sets = "from slotserve.runners.pytorch.cpu_kernels import load_cpu_kernels as f; k = f()\n"
    sets += "print(k.isa, k.gemm)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", sets], timeout=300, capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split()[-2:] == ["avx2", "avx2"]
