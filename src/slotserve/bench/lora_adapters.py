"""Random LoRA adapters for an HF checkpoint, written by PEFT itself (``peft``, a test
dependency): the folders the LoRA tests and benchmark serve, and transformers + PEFT on them as
the tests' reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(
    base: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_TARGETS,
    **settings: object,
) -> Path:
    """A PEFT LoRA folder for ``base`` with random A and B (PEFT starts B at zero, which would
    make the adapter a no-op): an update large enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        init_lora_weights=False,
        **settings,  # type: ignore[arg-type]
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    peft_model.save_pretrained(str(out))
    return out


def peft_model(base: Path, adapter: Path, merged: bool = False) -> torch.nn.Module:
    """transformers' model of ``base`` with the adapter applied by PEFT (float32, CPU), or
    merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(model, str(adapter))
    result: torch.nn.Module = adapted.merge_and_unload() if merged else adapted
    result.train(False)
    return result


# llama.cpp's tensor names of the projections an adapter may target.
GGUF_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_gguf_adapter(
    base: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = GGUF_TARGETS,
) -> Path:
    """A GGUF LoRA adapter for the GGUF model ``base``, laid out as llama.cpp's
    ``convert_lora_to_gguf.py`` writes one (``lora_a``: rank × inputs, ``lora_b``: outputs ×
    rank, alpha in ``adapter.lora.alpha``), with random values large enough to change greedy
    tokens."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(base))
    architecture = str(reader.fields["general.architecture"].contents())
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(2 * rank))
    for tensor in reader.tensors:
        stem = tensor.name.removesuffix(".weight")
        if stem.split(".")[-1] not in targets or not stem.startswith("blk."):
            continue
        inputs, outputs = (int(n) for n in tensor.shape[:2])  # ggml's order: columns first
        down = rng.normal(0.0, inputs**-0.5, (rank, inputs)).astype(np.float32)
        up = rng.normal(0.0, 0.02, (outputs, rank)).astype(np.float32)
        writer.add_tensor(f"{tensor.name}.lora_a", down)
        writer.add_tensor(f"{tensor.name}.lora_b", up)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
