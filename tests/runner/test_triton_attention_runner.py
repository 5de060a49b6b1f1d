"""The PyTorch runner with its attention as the Triton kernels (``--attention-backend triton``),
and with ``--batch-invariant`` (Triton matmuls too), run by Triton's interpreter on the CPU:
small random models give torch attention's greedy tokens through chunked prefill, decode, a
prefix-cache hit and sliding windows, and the same tokens alone and batched; the choices are
refused where the kernels cannot run or do not cover a layer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.pytorch import gpu_kernels
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from slotserve.runners.pytorch.shard.model_shard import triton_attention
from tests.prompts import PROMPTS
from tests.runner.engine_runs import alone_then_together, generate, greedy
from tests.runner.hf_checkpoint import tiny_random_checkpoint

pytestmark = pytest.mark.skipif(
    not gpu_kernels.available() or not gpu_kernels.interpreted(),
    reason="Triton is not installed, or this machine runs it on a GPU (test_torch_cuda.py)",
)

# Small enough for the interpreter: two or three layers, a few heads.
SMALL: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


@pytest.fixture(
    scope="module",
    params=["llama", "gemma3_text", "qwen3_5_text"],
    ids=["llama", "gemma3-sliding", "qwen35-gated"],
)
def folder(
    request: pytest.FixtureRequest, hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    family = request.param
    layers = 2 if family == "llama" else 4 if family == "qwen3_5_text" else 3
    out = tmp_path_factory.mktemp(family)
    yield tiny_random_checkpoint(
        family, hf_checkpoint, out, num_hidden_layers=layers, head_dim=16, **SMALL
    )


def run(folder: Path, backend: str) -> dict[str, list[int]]:
    """Greedy tokens of prompts in chunks of 16 tokens (64, Gated DeltaNet's block, for
    Qwen3.5), then a prompt sharing the first's cached prefix (a hit where the model keeps
    no recurrent state)."""
    recurrent = "qwen3_5" in folder.name
    runner = TorchRunner(
        TorchLoadConfig(folder, num_slots=3, dtype="float32", attention_backend=backend)
    )
    assert runner.shard.triton == (backend == "triton")
    core = EngineCore(runner, EngineConfig(num_slots=3, prefill_chunk=64 if recurrent else 16))
    prompts = [runner.tokenizer.encode(p * 3) for p in PROMPTS[:3]]
    tokens = generate(core, {f"p{i}": (p, greedy(8)) for i, p in enumerate(prompts)})
    tokens |= generate(core, {"again": (prompts[0] + prompts[1], greedy(8))})
    assert recurrent or core.snapshot().prefix_cache.hit_tokens > 0
    runner.close()
    return tokens


def test_triton_attention_gives_torch_attentions_tokens(folder: Path) -> None:
    assert run(folder, "triton") == run(folder, "torch")


def test_batch_invariant_tokens_are_the_same_alone_and_batched(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    """``--batch-invariant`` (bfloat16, Triton attention and matmuls): each sequence alone,
    then all of them batched with staggered starts, give the same bits. One small model: the
    interpreter runs the head's matmul over the whole vocabulary."""
    folder = tiny_random_checkpoint(
        "llama", hf_checkpoint, tmp_path, num_hidden_layers=2, head_dim=16, **SMALL
    )
    runner = TorchRunner(TorchLoadConfig(folder, num_slots=3, batch_invariant=True))
    compute = runner.model_info.compute
    assert compute.batch_invariant and "invariant Triton matmuls" in compute.kernels
    core = EngineCore(runner, EngineConfig(num_slots=3, prefill_chunk=16, prefix_cache=False))
    prompts = [runner.tokenizer.encode(p * 2) for p in PROMPTS[3:6]]
    staggered = {"p1": ("p0", 2), "p2": ("p0", 3)}
    alone, together = alone_then_together(core, prompts, greedy(4), staggered)
    runner.close()
    assert together == alone


def test_batch_invariance_refuses_the_layers_it_does_not_cover(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    moe = tiny_random_checkpoint(
        "qwen3_moe", hf_checkpoint, tmp_path, num_hidden_layers=2, head_dim=16, **SMALL
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        TorchRunner(TorchLoadConfig(moe, num_slots=1, batch_invariant=True))


def test_the_backend_is_refused_where_its_kernels_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert not triton_attention("auto", cpu)  # the CPU kernels' or torch's attention
    assert triton_attention("auto", torch.device("cuda"))  # Triton is installed here
    assert triton_attention("triton", cpu)  # the interpreter runs it here
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs Triton"):  # on a CPU, outside the interpreter
        triton_attention("triton", cpu)
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        triton_attention("flash", cpu)
