"""HF checkpoints for the PyTorch runner's tests, made offline: the shipped GGUF converted to a
safetensors folder, and tiny random models of each supported family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slotserve.bench.hf_gguf import q8_0_gguf, qwen3_moe_gguf, qwen35_gguf
from slotserve.bench.hf_reference import convert_gguf_to_hf

__all__ = [
    "convert_gguf_to_hf",
    "q8_0_gguf",
    "qwen3_moe_gguf",
    "qwen35_gguf",
    "tiny_random_checkpoint",
]


QWEN3_5: dict[str, Any] = {
    "head_dim": 32,
    "full_attention_interval": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
}


def tiny_random_checkpoint(
    family: str,
    tokenizer_dir: Path,
    out_dir: Path,
    sequence_classifier: bool = False,
    **overrides: Any,
) -> Path:
    """A small random model of ``family`` saved by transformers itself, with the SmolLM2
    tokenizer (its vocabulary size): the reference implementation for parity tests.
    ``sequence_classifier``: the family's ``ForSequenceClassification`` with one label (a
    reranker), its score head wide enough that scores spread."""
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
        # A dense first layer, then sparse ones: both MLP kinds and the router in one model.
        "qwen3_moe": (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {
                "head_dim": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "norm_topk_prob": True,
                "mlp_only_layers": [0],
            },
        ),
        # Gated DeltaNet and gated full attention alternating (layer_types from the interval).
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5),
        "qwen3_5_moe_text": (
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            {
                **QWEN3_5,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 96,
            },
        ),
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
    if sequence_classifier:
        model_name = model_name.replace("ForCausalLM", "ForSequenceClassification")
        config.num_labels = 1
        config.pad_token_id = AutoTokenizer.from_pretrained(str(tokenizer_dir)).pad_token_id
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random norm weights too, so a misplaced norm shows
        for name, parameter in model.named_parameters():
            # Gemma's and Qwen3.5's norms store (w - 1), but for the DeltaNet output's.
            plus_one = family.startswith(("gemma3", "qwen3_5")) and "linear_attn" not in name
            if "norm" in name:
                parameter.normal_(0.0 if plus_one else 1.0, 0.1)
            elif name.endswith(("A_log", "dt_bias")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
            elif name == "score.weight":
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out_dir)
    return out_dir
