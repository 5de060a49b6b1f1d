"""Decode steps through the CUDA-graph bookkeeping (``cuda_graphs.py``) on the CPU, where no
graph can be captured: a stand-in "graph" replays by running the step again over its bucket's
buffers, so the inputs staged per step, the buckets, the ballast rows and the logits read back
are the ones a CUDA graph would see. The tokens must be the eager runner's. The graphs
themselves run in test_torch_cuda.py on a GPU."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.pytorch import gpu_kernels
from slotserve.runners.pytorch.load.checkpoint import read_model_config
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from slotserve.runners.pytorch.shard.cuda_graphs import Capture, Graph, batch_buckets
from slotserve.runners.pytorch.shard.model_shard import decode_graphs_apply
from tests.prompts import PROMPTS
from tests.runner.engine_runs import generate, greedy
from tests.runner.hf_checkpoint import tiny_random_checkpoint

SMALL: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
SLOTS = 5


class Rerun:
    """Replays by running the step again, writing its logits where the capture put them."""

    def __init__(self, run: Callable[[], torch.Tensor], logits: torch.Tensor, used: Counter[int]):
        self.run, self.logits, self.used = run, logits, used

    def replay(self) -> None:
        self.logits.copy_(self.run())
        self.used[self.logits.shape[0]] += 1


def rerun_capture(used: Counter[int]) -> Capture:
    def capture(run: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        logits = run()
        return Rerun(run, logits, used), logits

    return capture


def test_buckets_are_small_powers_of_two_then_every_sixteen() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.skipif(
    not gpu_kernels.available() or not gpu_kernels.interpreted(),
    reason="Triton is not installed, or this machine runs it on a GPU (test_torch_cuda.py)",
)
@pytest.mark.parametrize("family", ["llama", "gemma3_text"], ids=["llama", "gemma3-sliding"])
def test_replayed_decode_steps_give_the_eager_tokens(
    family: str, hf_checkpoint: Path, tmp_path: Path
) -> None:
    """Staggered starts make decode batches of 1 to 5 sequences (3 runs in bucket 4, beside a
    ballast row), a prefix-cache hit decodes after a copied block; every token is eager's."""
    layers = 3 if family == "gemma3_text" else 2
    folder = tiny_random_checkpoint(
        family, hf_checkpoint, tmp_path, num_hidden_layers=layers, head_dim=16, **SMALL
    )
    load = TorchLoadConfig(folder, num_slots=SLOTS, dtype="float32", attention_backend="triton")
    runner = TorchRunner(load)
    assert runner.shard.graphs is None  # no CUDA device: eager
    prompts = [runner.tokenizer.encode(p * 2) for p in PROMPTS[:SLOTS]]
    jobs = {f"p{i}": (p, greedy(6)) for i, p in enumerate(prompts)}
    staggered = {f"p{i}": ("p0", i) for i in range(1, SLOTS)}
    again = {"again": (prompts[0] + prompts[1][:5], greedy(6))}

    def run() -> dict[str, list[int]]:
        core = EngineCore(runner, EngineConfig(num_slots=SLOTS, prefill_chunk=16))
        tokens = generate(core, jobs, start_after=staggered)
        tokens |= generate(core, again)
        assert core.snapshot().prefix_cache.hit_tokens > 0
        return tokens

    eager = run()
    used: Counter[int] = Counter()
    runner.shard.graphs = runner.shard.capture_decode(SLOTS, rerun_capture(used))
    assert runner.shard.graphs.sizes == [1, 2, 4, 5]
    assert run() == eager
    assert used[4] and used[1], used  # bucket 4 served 3 sequences beside a ballast row
    pool = runner.shard.pool
    zero = pool.zero_block * pool.block_size
    for keys, values in pool.layers:  # what gathers pad with
        assert not keys[zero : zero + pool.block_size].any()
        assert not values[zero : zero + pool.block_size].any()
    # The ballast wrote where no sequence reads (a padding token's first-layer K may be 0).
    assert any(keys[pool.ballast_row].any() for keys, _ in pool.layers)
    runner.close()


def test_graphs_are_captured_only_where_a_step_can_be(hf_checkpoint: Path, tmp_path: Path) -> None:
    dense = tiny_random_checkpoint("llama", hf_checkpoint, tmp_path / "d", head_dim=16, **SMALL)
    moe = tiny_random_checkpoint("qwen3_moe", hf_checkpoint, tmp_path / "m", head_dim=16, **SMALL)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    load = TorchLoadConfig(dense)
    config = read_model_config(dense)
    assert decode_graphs_apply(load, config, cuda, True, None)
    assert not decode_graphs_apply(load, config, cuda, False, None)  # torch attention
    assert not decode_graphs_apply(load, config, cpu, True, None)
    eager = TorchLoadConfig(dense, enforce_eager=True)
    assert not decode_graphs_apply(eager, config, cuda, True, None)
    assert not decode_graphs_apply(TorchLoadConfig(moe), read_model_config(moe), cuda, True, None)
