"""4-bit AWQ, GPTQ and compressed-tensors checkpoints written offline from an HF folder, as
AutoAWQ's GEMM layout, GPTQ's and llm-compressor's ``pack-quantized`` pack them: round-to-nearest
per group of inputs (the calibration those tools add changes the values, never the layout). The
tests check the runner's reading of each layout against this writing of it; ``bench model-file``
writes benchmark models of real shapes with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from slotserve.runners.pytorch.load.hf_folder import safetensors_tensors
from slotserve.runners.pytorch.quant.int4_blocks import AWQ_ORDER

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(
    weight: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as codes [out, in], zeros and scales [out, in / group] (fp16 as AWQ
    and GPTQ keep them, or bfloat16 as llm-compressor does for a bfloat16 model)."""
    out, k = weight.shape
    grouped = weight.float().view(out, k // group, group)
    if symmetric:
        scales = (grouped.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8).to(scale_dtype)
        zeros = torch.round(-low / scales.float()).clamp(0, 15).to(torch.int32)
    codes = torch.round(grouped / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)
    return codes.clamp(0, 15).to(torch.int32).view(out, k), zeros, scales


def _words(fields: torch.Tensor) -> torch.Tensor:
    """[..., 8n] 4-bit fields as [..., n] int32 words, the first field lowest."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    grouped = fields.to(torch.int64).view(*fields.shape[:-1], -1, 8)
    words = (grouped << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """AutoAWQ's ``WQLinear_GEMM``: outputs packed eight a word in ``AWQ_ORDER``."""
    order = torch.tensor(
        [c * 8 + j for c in range(codes.shape[0] // 8) for j in AWQ_ORDER], dtype=torch.int64
    )
    return {
        "qweight": _words(codes.t()[:, order]),
        "qzeros": _words(zeros.t()[:, order]),
        "scales": scales.t().contiguous(),
    }


def gptq_pack(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, v1: bool = True
) -> dict[str, torch.Tensor]:
    """GPTQ's: inputs packed eight a word down each output's column, zeros eight outputs a
    word (less one, and masked to 4 bits, in the original format)."""
    k, groups = codes.shape[1], zeros.shape[1]
    stored = (zeros - 1) & 15 if v1 else zeros
    return {
        "qweight": _words(codes).t().contiguous(),
        "qzeros": _words(stored.t().contiguous()),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(k) // (k // groups)).to(torch.int32),
    }


def compressed_pack(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, symmetric: bool
) -> dict[str, torch.Tensor]:
    """compressed-tensors' ``pack-quantized``: values (signed, stored plus 8) eight inputs a
    word along each output's row; zero points (signed, plus 8) eight outputs a word."""
    packed = {
        "weight_packed": _words(codes),
        "weight_scale": scales,
        "weight_shape": torch.tensor(codes.shape),
    }
    if not symmetric:
        packed["weight_zero_point"] = _words(zeros.t().contiguous()).t().contiguous()
    return packed


def _packed(
    method: str, ints: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if method == "awq":
        return awq_pack(*ints)
    if method.startswith("compressed"):
        return compressed_pack(*ints, symmetric=method.endswith("sym"))
    return gptq_pack(*ints)


def _quantization_config(method: str, group: int) -> dict[str, object]:
    symmetric = method.endswith("sym")
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
    if method.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": symmetric,
            "checkpoint_format": "gptq",
        }
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights | {"group_size": group}}
        },
        "ignore": ["lm_head"],
    }


def int4_checkpoint(hf_folder: Path, out_dir: Path, method: str, group: int = 64) -> Path:
    """``hf_folder`` with every decoder projection's weight quantized: ``awq``, ``gptq`` or
    ``compressed`` (asymmetric), ``gptq-sym`` or ``compressed-sym``; the embedding stays dense,
    as the tools leave it."""
    shutil.copytree(hf_folder, out_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in safetensors_tensors(hf_folder):
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            written[name] = tensor.half()
            continue
        bf16 = method.startswith("compressed")
        scale_dtype = torch.bfloat16 if bf16 else torch.float16
        ints = rtn_int4(tensor, group, method.endswith("sym"), scale_dtype)
        written.update({f"{prefix}.{key}": value for key, value in _packed(method, ints).items()})
    save_file(written, str(out_dir / "model.safetensors"))
    config = json.loads((hf_folder / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = _quantization_config(method, group)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
