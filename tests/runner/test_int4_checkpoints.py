"""AWQ and GPTQ 4-bit checkpoints on the PyTorch runner (``load/int4_checkpoint.py``,
``quant/int4_blocks.py``): their layouts read back as the integers their tools pack, kept as the
GGUF blocks that equal them bit for bit, served by the quantized kernels (or dequantized), and
what the runner does not read refused by name before any weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGMLQuantizationType

from slotserve.bench.int4_folders import (
    awq_pack,
    compressed_pack,
    gptq_pack,
    int4_checkpoint,
    rtn_int4,
)
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.hf_folder import HfFolder
from slotserve.runners.pytorch.load.int4_checkpoint import int4_scheme, int4_tensors
from slotserve.runners.pytorch.load.memory import estimate_memory
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.model.layers import Projection
from slotserve.runners.pytorch.quant.formats import FORMATS
from slotserve.runners.pytorch.quant.int4_blocks import (
    Int4Weight,
    awq_weight,
    gptq_weight,
    packed_weight,
)
from slotserve.runners.pytorch.runner import TorchRunner
from tests.conftest import start_server, stop_server
from tests.runner.engine_runs import greedy_alone_then_together
from tests.runner.hf_checkpoint import tiny_random_checkpoint
from tests.runner.quant_reference import dequantized


def _reference(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = codes.shape[1] // zeros.shape[1]
    steps = (codes - zeros.repeat_interleave(group, dim=1)).float()
    return steps * scales.float().repeat_interleave(group, dim=1)


def _read(method: str, packed: dict[str, torch.Tensor]) -> Int4Weight:
    if method == "awq":
        return awq_weight(packed["qweight"], packed["qzeros"], packed["scales"])
    if method == "compressed":
        zero_points = packed.get("weight_zero_point")
        return packed_weight(packed["weight_packed"], packed["weight_scale"], zero_points, None)
    return gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 1)


def _pack(
    method: str, symmetric: bool, ints: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if method == "compressed":
        return compressed_pack(*ints, symmetric=symmetric)
    return (awq_pack if method == "awq" else gptq_pack)(*ints)


@pytest.mark.parametrize(
    ("symmetric", "group", "kind"),
    [(True, 64, "Q4_0"), (False, 64, "Q5_0"), (False, 128, "Q4_ZP"), (False, 256, "Q4_ZP")],
)
@pytest.mark.parametrize("method", ["awq", "gptq", "compressed"])
def test_packed_weights_read_back_as_the_blocks_that_equal_them(
    kernels: CpuKernels, method: str, symmetric: bool, group: int, kind: str
) -> None:
    """The integers read back are the ones packed; the blocks made of them hold ``s · (q − z)``
    exactly (dequantized by gguf-py, or Q4_ZP's by its stated layout), and the kernels' rows
    of them are those values in bfloat16."""
    torch.manual_seed(0)
    scale_dtype = torch.bfloat16 if method == "compressed" else torch.float16
    codes, zeros, scales = rtn_int4(torch.randn(48, 512), group, symmetric, scale_dtype)
    weight = _read(method, _pack(method, symmetric, (codes, zeros, scales)))
    assert torch.equal(weight.codes.int(), codes) and torch.equal(weight.zeros.int(), zeros)
    reference = _reference(codes, zeros, scales)
    assert torch.equal(weight.dense(), reference)
    blocks = weight.blocks()
    assert blocks.kind.name == kind and blocks.shape == (48, 512)
    assert np.array_equal(dequantized(blocks.raw, blocks.kind, 48, 512), reference.numpy())
    packed = kernels.quant_pack(blocks.kind, blocks.raw, 512)
    rows = kernels.quant_rows(packed, torch.arange(48), FORMATS[blocks.kind], 48, 512)
    assert torch.equal(rows, reference.bfloat16())


def test_gptq_zeros_read_as_their_kernels_read_them() -> None:
    """The original GPTQ format stores zero − 1 in 4 bits: a zero of 0 is stored as 15 and its
    kernels read 16 (the weights the checkpoint was evaluated with); ``gptq_v2`` as stored."""
    codes = torch.randint(0, 16, (8, 32), dtype=torch.int32)
    zeros = torch.tensor([[0], [1], [8], [15], [0], [3], [7], [9]], dtype=torch.int32)
    scales = torch.full((8, 1), 0.5, dtype=torch.float16)
    packed = gptq_pack(codes, zeros, scales)
    v1 = gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], None, 1)
    assert v1.zeros[:, 0].tolist() == [16, 1, 8, 15, 16, 3, 7, 9]
    v2 = gptq_pack(codes, zeros, scales, v1=False)
    assert gptq_weight(v2["qweight"], v2["qzeros"], v2["scales"], None, 0).zeros[:, 0].tolist() == (
        zeros[:, 0].tolist()
    )
    blocks = v1.blocks()  # codes down to q − 16 still fit Q5_0's
    assert np.array_equal(dequantized(blocks.raw, blocks.kind, 8, 32), v1.dense().numpy())


def test_layouts_the_kernels_cannot_take_are_refused() -> None:
    codes, zeros, scales = rtn_int4(torch.randn(16, 64), 16, symmetric=False)
    with pytest.raises(ValueError, match="groups of 16 inputs"):
        awq_weight(**awq_pack(codes, zeros, scales)).blocks()
    codes, zeros, scales = rtn_int4(torch.randn(16, 64), 32, symmetric=False)
    packed = gptq_pack(codes, zeros, scales)
    parts = [("layer.q_proj.qweight", packed["qweight"]), ("layer.q_proj.scales", scales)]
    scheme = int4_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert scheme is not None
    with pytest.raises(ValueError, match=r"layer\.q_proj lacks its qzeros"):
        list(int4_tensors(iter(parts), scheme, keep_quantized=True))


def test_act_order_weights_are_read_by_their_groups_and_left_dense() -> None:
    """GPTQ's act-order puts inputs far apart in one group (``g_idx``): the weights are read by
    it exactly, and given dense (the load rounds them to Q8_0), since no block holds them."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (16, 128), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 16, (16, 4), generator=gen, dtype=torch.int32)  # v1 stores 0 as 16
    scales = (torch.rand(16, 4, generator=gen) / 50 + 1e-3).half()
    group_of = (torch.arange(128) // 32)[torch.randperm(128, generator=gen)]
    packed = gptq_pack(codes, zeros, scales) | {"g_idx": group_of.to(torch.int32)}
    reference = (codes - zeros[:, group_of]).float() * scales.float()[:, group_of]
    weight = _read("gptq", packed)
    assert not weight.in_runs and torch.equal(weight.dense(), reference)
    with pytest.raises(ValueError, match="act-order"):
        weight.blocks()
    scheme = int4_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert scheme is not None
    parts = iter((f"layer.up_proj.{name}", tensor) for name, tensor in sorted(packed.items()))
    ((name, kept),) = list(int4_tensors(parts, scheme, keep_quantized=True))
    assert name == "layer.up_proj.weight" and torch.equal(kept, reference)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("quantization", "refusal"),
    [
        ({"quant_method": "fp8"}, "fp8 quantized checkpoints are not served"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes quantized"),
        ({"quant_method": "gptq", "bits": 8}, "8-bit GPTQ weights"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ's gemv layout"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "without zeros"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ's marlin"),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized"},
            "compressed-tensors' float-quantized format",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            "8-bit int",
        ),
    ],
)
def test_quantizations_not_read_are_refused_by_name(
    quantization: dict[str, object], refusal: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=refusal):
        int4_scheme({"quantization_config": quantization})


@pytest.fixture(scope="module")
def int4_folders(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    methods = ("awq", "gptq", "gptq-sym", "compressed")
    return {m: int4_checkpoint(hf_checkpoint, root / m, m) for m in methods}


def _runner(path: Path, **options: object) -> TorchRunner:
    return TorchRunner(TorchLoadConfig(path, num_slots=4, max_model_len=512, **options))  # type: ignore[arg-type]


def _checkpoint_q_proj(folder: Path, method: str) -> torch.Tensor:
    """Layer 0's q_proj as the checkpoint's integers say, in float32."""
    from safetensors import safe_open

    prefix = "model.layers.0.self_attn.q_proj."
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = [name for name in f.keys() if name.startswith(prefix)]  # noqa: SIM118
        packed = {name.removeprefix(prefix): f.get_tensor(name) for name in names}
    return _read(method.removesuffix("-sym"), packed).dense()


@pytest.mark.parametrize(
    ("method", "kinds"),
    [("awq", "Q5_0, Q8_0"), ("gptq-sym", "Q4_0, Q8_0"), ("compressed", "Q5_0, Q8_0")],
)
def test_a_folder_is_served_from_the_checkpoints_own_values(
    int4_folders: dict[str, Path], method: str, kinds: str
) -> None:
    """Every projection kept quantized, its packed weights the checkpoint's values (bfloat16,
    as every weight the runner holds), the same under ``--quantization none``; each path's
    greedy tokens alone equal its tokens batched."""
    folder = int4_folders[method]
    expected = _checkpoint_q_proj(folder, method).to(torch.bfloat16)
    quantized, dense = _runner(folder), _runner(folder, quantization="none")
    try:
        assert f"weights kept quantized ({kinds})" in quantized.model_info.compute.kernels
        model = quantized.shard.model
        projections = [m for m in model.modules() if isinstance(m, Projection)]
        assert all(p.quant_parts for p in projections)
        packed = sum(part.packed.numel() for p in projections for part in p.quant_parts or [])
        kept = estimate_memory(TorchLoadConfig(folder)).weights_bytes  # the pre-flight's
        assert (
            packed
            <= kept
            < estimate_memory(TorchLoadConfig(folder, quantization="none")).weights_bytes
        )
        parts = model.decoder_layers[0].qkv.quant_parts  # q's rows first: one part per type
        assert parts is not None and model.kernels is not None
        part, (n, k) = parts[0], expected.shape
        rows = model.kernels.quant_rows(part.packed, torch.arange(n), part.format, part.rows, k)
        assert torch.equal(rows, expected)
        dense_tensors = dict(HfFolder(folder).tensors())  # what --quantization none stores
        assert torch.equal(
            dense_tensors["model.layers.0.self_attn.q_proj.weight"].bfloat16(), expected
        )
        for runner in (quantized, dense):
            alone, together = greedy_alone_then_together(runner, 8)
            assert together == alone and all(len(t) == 8 for t in alone.values())
    finally:
        quantized.close()
        dense.close()


def test_quantization_flags_must_match_the_checkpoint(int4_folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"config\.json names gptq quantization"):
        _runner(int4_folders["gptq"], quantization="awq")
    with pytest.raises(ValueError, match="a quantized checkpoint keeps its own types"):
        _runner(int4_folders["awq"], quantization="Q8_0")
    with pytest.raises(ValueError, match=r"config\.json names awq quantization"):
        _runner(int4_folders["awq"], quantization="gptq_marlin")
    runner = _runner(int4_folders["gptq"], quantization="gptq_marlin")  # vLLM's spelling
    try:
        assert "weights kept quantized (Q5_0, Q8_0)" in runner.model_info.compute.kernels
    finally:
        runner.close()


def test_the_server_answers_from_an_awq_folder(
    int4_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = str(int4_folders["awq"])
    proc = start_server(tmp_path, "--model", folder, "-q", "awq", "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=proc.api_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="awq",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
        )
    finally:
        stop_server(proc)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_mixture_of_experts_keeps_its_experts_quantized(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    """Each expert's projections are quantized tensors of their own (``experts.{e}.*_proj``),
    as the hub's Qwen3-MoE AWQ and GPTQ checkpoints store them: kept as their blocks."""
    dense = tiny_random_checkpoint("qwen3_moe", hf_checkpoint, tmp_path / "dense")
    runner = _runner(int4_checkpoint(dense, tmp_path / "awq", "awq"))
    try:
        layers = runner.shard.model.decoder_layers
        experts = [e for layer in layers if layer.sparse for e in layer.moe.experts]
        assert experts and all(
            part.format == FORMATS[GGMLQuantizationType.Q5_0]
            for e in experts
            for p in (e.gate_up, e.down)
            for part in p.quant_parts or [None]  # type: ignore[list-item]
        )
        alone, together = greedy_alone_then_together(runner, 8)
        assert together == alone
    finally:
        runner.close()
