"""HF checkpoints for the PyTorch runner's tests, made offline: the shipped GGUF converted to a
safetensors folder, and tiny random models of each supported family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slotserve.bench.hf_reference import convert_gguf_to_hf

__all__ = ["convert_gguf_to_hf", "tiny_random_checkpoint"]


def tiny_random_checkpoint(
    family: str, tokenizer_dir: Path, out_dir: Path, **overrides: Any
) -> Path:
    """A small random model of ``family`` saved by transformers itself, with the SmolLM2
    tokenizer (its vocabulary size): the reference implementation for parity tests."""
    import transformers
    from transformers import AutoTokenizer

    common: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    classes: dict[str, tuple[str, str, dict[str, Any]]] = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 48}),
        "gemma3_text": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {
                "head_dim": 32,
                "num_hidden_layers": 6,
                "sliding_window": 16,
                "query_pre_attn_scalar": 32,
                "tie_word_embeddings": True,
            },
        ),
    }
    config_name, model_name, family_settings = classes[family]
    config = getattr(transformers, config_name)(**{**common, **family_settings, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random norm weights too, so a misplaced norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0 if family == "gemma3_text" else 1.0, 0.1)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out_dir)
    return out_dir
