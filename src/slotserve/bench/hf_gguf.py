"""HF folders written as GGUF files the way llama.cpp's converter writes them (Qwen3-MoE,
Qwen3.5), and llama.cpp's quantiser: models of chosen shapes for the llama.cpp runner, without
the converter (it lives in llama.cpp's repository, not in a package)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def qwen3_moe_gguf(folder: Path, out_path: Path) -> Path:
    """A tiny Qwen3-MoE HF folder written as llama.cpp's converter writes it (float32): the
    ``qwen3moe`` architecture, every expert's gate/up/down stacked on a new first axis."""
    import json

    import gguf
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    hp = json.loads((folder / "config.json").read_text())
    layers = hp["num_hidden_layers"]
    experts = hp.get("num_experts") or hp["num_local_experts"]
    arch = gguf.MODEL_ARCH.QWEN3MOE
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf_writer(out_path, gguf.MODEL_ARCH_NAMES[arch], hp)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])

    def gguf_name(hf_name: str) -> str:
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        return name

    tensors = {
        gguf_name(name): value for name, value in weights.items() if ".mlp.experts." not in name
    }
    tensors |= _stacked_experts(weights, names, layers, experts)
    return _write(writer, tensors, out_path)


def qwen35_gguf(folder: Path, out_path: Path, tokenizer_gguf: Path) -> Path:
    """A tiny Qwen3.5 HF folder (text model) written as llama.cpp's converter writes it
    (float32, ``qwen35`` / ``qwen35moe``): ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as
    ``ssm_dt.bias``, the convolution squeezed, ``1 + w`` norms stored with the 1 added (not
    the DeltaNet output norm), value heads reordered from grouped to tiled when there are
    fewer key heads, experts stacked; the vocabulary copied from ``tokenizer_gguf``, so
    llama.cpp can run it too."""
    import json

    import gguf
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    hp = json.loads((folder / "config.json").read_text())
    layers, experts = hp["num_hidden_layers"], hp.get("num_experts", 0)
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    arch = gguf.MODEL_ARCH.QWEN35MOE if experts else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf_writer(out_path, gguf.MODEL_ARCH_NAMES[arch], hp)
    writer.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(int(hp["head_dim"] * 0.25))
    writer.add_rope_dimension_sections([int(hp["head_dim"] * 0.25) // 2, 0, 0, 0])
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(nv * dv)
    # The converter writes config.json's interval; transformers saves ``layer_types`` instead.
    writer.add_full_attention_interval(hp["layer_types"].index("full_attention") + 1)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hp["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    copy_vocabulary(gguf.GGUFReader(str(tokenizer_gguf)), writer)

    def tiled(rows: torch.Tensor, block: int) -> torch.Tensor:
        grouped = rows.reshape(nk, nv // nk, block, *rows.shape[1:])
        return grouped.transpose(0, 1).reshape(rows.shape)

    tensors: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight") and "linear_attn" not in name:
            value = value + 1
        if ".linear_attn." in name and nk != nv:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                value = torch.cat([value[: 2 * nk * dk], tiled(value[2 * nk * dk :], dv)])
            elif name.endswith("in_proj_z.weight"):
                value = tiled(value, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                value = tiled(value, 1)
            elif name.endswith("out_proj.weight"):
                value = tiled(value.T, dv).T
        if name.endswith("A_log"):
            value = -torch.exp(value)
        elif name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        elif "conv1d" in name:
            value = value.squeeze(1)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))  # suffix kept
        assert gguf_name is not None, name
        tensors[gguf_name] = value
    if experts:
        tensors |= _stacked_experts(weights, names, layers, experts)
    return _write(writer, tensors, out_path)


def q8_0_gguf(path: Path, out_path: Path) -> Path:
    """``path`` quantised to Q8_0 by llama.cpp, as served GGUFs are: ggml's float32 matrix
    products round differently by batch size, so llama.cpp is batch-invariant on quantised
    weights only."""
    import llama_cpp as llama

    from slotserve.runners.llama_cpp.backend import init_llama_backend

    init_llama_backend()  # its log goes to ours
    params = llama.llama_model_quantize_default_params()
    params.ftype = llama.LLAMA_FTYPE_MOSTLY_Q8_0
    status = llama.llama_model_quantize(str(path).encode(), str(out_path).encode(), params)
    assert status == 0, f"llama_model_quantize returned {status}"
    return out_path


def gguf_writer(out_path: Path, arch: str, hp: dict[str, Any]) -> Any:
    """A ``GGUFWriter`` for the architecture named ``arch`` (``qwen3``) with the metadata every
    decoder has, from config.json."""
    import gguf

    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp.get("intermediate_size", 0))
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    return writer


def _stacked_experts(
    weights: dict[str, torch.Tensor], names: Any, layers: int, experts: int
) -> dict[str, torch.Tensor]:
    """Every layer's per-expert gate/up/down stacked on a new first axis (``ffn_*_exps``)."""
    import torch

    stacked = {}
    for block in range(layers):
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = names.get_name(f"model.layers.{block}.mlp.experts.{part}")
            stacked[f"{name}.weight"] = torch.stack(
                [
                    weights[f"model.layers.{block}.mlp.experts.{e}.{part}.weight"]
                    for e in range(experts)
                ]
            )
    return stacked


def _write(writer: Any, tensors: dict[str, torch.Tensor], out_path: Path) -> Path:
    import numpy as np

    for name, value in tensors.items():
        writer.add_tensor(name, value.contiguous().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def copy_vocabulary(reader: Any, writer: Any) -> None:
    fields = reader.fields
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"].contents())
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"].contents())
