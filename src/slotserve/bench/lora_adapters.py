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
