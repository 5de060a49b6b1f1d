"""Weights that stay quantized in the PyTorch runner (``load/quant_weights.py``): a GGUF file's
blocks as stored, an HF checkpoint's rounded at load (``--quantization``); the engine's
invariance on them is the behaviour tests' (``test_runner_behaviour.py`` runs on the GGUF
through this path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.memory import estimate_memory
from slotserve.runners.pytorch.load.quant_weights import QuantEmbedding
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.layers import Projection
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import greedy_alone_then_together
from tests.runner.test_embeddings import embed


def _runner(path: Path, **options: object) -> TorchRunner:
    return TorchRunner(TorchLoadConfig(path, num_slots=4, max_model_len=512, **options))  # type: ignore[arg-type]


def _projections(runner: TorchRunner) -> list[Projection]:
    return [m for m in runner.shard.model.modules() if isinstance(m, Projection)]


@pytest.fixture(scope="module")
def dequantized(model_path: Path) -> Iterator[TorchRunner]:
    runner = _runner(model_path, quantization="none")
    yield runner
    runner.close()


def test_a_gguf_file_is_served_from_its_own_blocks(
    kernels: CpuKernels, torch_runner: TorchRunner, dequantized: TorchRunner, model_path: Path
) -> None:
    """Every projection and the embedding keep the file's types, in about the file's bytes;
    ``--quantization none`` holds them dequantized, as before."""
    assert "weights kept quantized (Q4_1, Q8_0)" in torch_runner.model_info.compute.kernels
    projections = _projections(torch_runner)
    assert all(p.quant_parts and p.weight.numel() == 0 for p in projections)
    packed = sum(part.packed.numel() for p in projections for part in p.quant_parts or [])
    # The tied LM head shares the embedding's packed blocks: counted once, it is the file.
    embedding = torch_runner.shard.model.embed
    assert embedding(torch.tensor([[1, 2]])).shape == (1, 2, 576)
    assert packed <= 1.1 * model_path.stat().st_size
    assert all(p.quant_parts is None for p in _projections(dequantized))
    assert "quantized" not in dequantized.model_info.compute.kernels


def _vm_flags(address: int) -> list[str]:
    """The flags of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="this kernel has no transparent huge pages",
)
def test_streamed_weights_and_kv_ask_for_huge_pages(
    kernels: CpuKernels, torch_runner: TorchRunner
) -> None:
    """A one-row step streams the weights and its context's KV from memory: their whole 2 MiB
    pages are advised huge (``hg``), the embedded model's Q8_0 table, a bfloat16 GEMM's weight
    and every layer's K and V pool among them; a buffer under one page is a plain one."""
    for layer in torch_runner.shard.pool.layers:
        for pool in layer:
            assert pool.numel() * pool.element_size() >= 2 << 20
            assert "hg" in _vm_flags(pool.data_ptr())
    embed = torch_runner.shard.model.embed
    assert isinstance(embed, QuantEmbedding)
    table = embed.part.packed
    assert table.numel() >= 2 << 20
    assert "hg" in _vm_flags(table.data_ptr())
    bf16 = kernels.pack_weight(torch.ones(2047, 1024, dtype=torch.bfloat16))
    assert "hg" in _vm_flags(bf16.data_ptr())
    assert bf16.float().sum() == 2047 * 1024  # the last block's missing row is zeros
    small = kernels.huge_page_buffer(4096)
    small.fill_(7)
    assert small.numel() == 4096 and int(small.sum()) == 7 * 4096


def test_prompts_are_the_dequantized_paths_where_the_gemm_is_amx(
    kernels: CpuKernels, torch_runner: TorchRunner, dequantized: TorchRunner
) -> None:
    """Where the projections run on the AMX GEMM, a prompt's rows multiply the dequantized
    weights on it: an embedding (the last prompt row's final state) is the dequantized path's to
    the bit, and the prefix cache keeps prompts only (a later prompt would compute a reply's
    tokens as a prompt). Elsewhere every row takes the integer sums, faster there than the
    vector GEMMs. Generated rows round each input block to 8 bits and sum in integers
    (csrc/quant_gemm.h): their tokens are not promised equal to the dequantized path's, but the
    first choice of each prompt is."""
    amx = kernels.gemm == "amx"
    assert torch_runner.shard.model.prompts_dequantized == amx
    texts = {f"e{i}": torch_runner.tokenizer.encode(PROMPTS[i]) for i in range(3)}

    def vectors_of(runner: TorchRunner) -> dict[str, list[float] | None]:
        core = EngineCore(runner, EngineConfig(num_slots=4))
        return {rid: out.embedding for rid, out in embed(core, texts).items()}

    vectors = [vectors_of(torch_runner), vectors_of(dequantized)]
    if amx and vectors[0] != vectors[1]:  # which side moved, and in what state of the kernels
        again = [vectors_of(torch_runner), vectors_of(dequantized)]
        pytest.fail(
            f"prompt rows differ from the dequantized path's; a second pass repeats: quantized "
            f"{again[0] == vectors[0]}, dequantized {again[1] == vectors[1]}, each other "
            f"{again[0] == again[1]}; kernels {kernels.isa}, gemm {kernels.gemm}, attention "
            f"{kernels.attention}, {torch.get_num_threads()} threads"
        )
    quantized_alone, quantized_together = greedy_alone_then_together(torch_runner, 8)
    dense_alone, _ = greedy_alone_then_together(dequantized, 8)
    assert quantized_together == quantized_alone
    assert len(dense_alone) == 4
    for prompt, tokens in dense_alone.items():
        assert quantized_alone[prompt][0] == tokens[0], prompt
    assert torch_runner.model_info.chunk_policy.cacheable_length(10, 14) == (10 if amx else 14)
    assert dequantized.model_info.chunk_policy.cacheable_length(10, 14) == 14


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_an_hf_checkpoint_is_quantized_at_load(hf_checkpoint: Path, kind: str) -> None:
    runner = _runner(hf_checkpoint, quantization=kind)
    try:
        projections = _projections(runner)
        kinds = {part.format for p in projections for part in p.quant_parts or []}
        assert len(kinds) <= 2 and all(p.quant_parts for p in projections)
        assert "weights kept quantized (" in runner.model_info.compute.kernels
        assert kind in runner.model_info.compute.kernels
        alone, together = greedy_alone_then_together(runner, 8)
        assert together == alone and all(len(t) == 8 for t in alone.values())
    finally:
        runner.close()


def test_quantization_the_load_cannot_serve_is_refused_by_name(
    model_path: Path, hf_checkpoint: Path
) -> None:
    with pytest.raises(ValueError, match="GGUF file keeps its own types"):
        _runner(model_path, quantization="Q8_0")
    with pytest.raises(ValueError, match="the CPU kernels do not serve"):
        _runner(hf_checkpoint, quantization="Q4_0", cpu_kernels=False)
    with pytest.raises(ValueError, match="the CPU kernels do not serve"):
        _runner(hf_checkpoint, quantization="Q8_0", dtype="float32")


def test_the_preflight_counts_weights_kept_quantized_at_their_bytes(
    model_path: Path, hf_checkpoint: Path, torch_runner: TorchRunner
) -> None:
    """The server refuses a model whose estimate does not fit: weights kept quantized are
    estimated at about what they take (the GGUF file's bytes; an HF checkpoint rounded at
    load at its type's), not at bfloat16's, or a file that fits would be refused."""
    kept = estimate_memory(TorchLoadConfig(model_path)).weights_bytes
    dense = estimate_memory(TorchLoadConfig(model_path, quantization="none")).weights_bytes
    file_bytes = model_path.stat().st_size
    assert file_bytes <= kept <= 1.3 * file_bytes + 1 < dense
    packed = sum(
        part.packed.numel() for p in _projections(torch_runner) for part in p.quant_parts or []
    )
    assert packed <= kept
    q4_0 = estimate_memory(TorchLoadConfig(hf_checkpoint, quantization="Q4_0")).weights_bytes
    q8_0 = estimate_memory(TorchLoadConfig(hf_checkpoint, quantization="Q8_0")).weights_bytes
    hf_dense = estimate_memory(TorchLoadConfig(hf_checkpoint)).weights_bytes
    assert q4_0 < q8_0 < 0.6 * hf_dense
