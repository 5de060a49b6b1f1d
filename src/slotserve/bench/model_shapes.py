"""Real models' configurations (HF ``config.json`` fields) for random-weight runs where the
checkpoints cannot travel: the GPU tests and benchmarks."""

from __future__ import annotations

from typing import Any

SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
# What a family's sizes share: context, rotary base and norm epsilon (and Qwen3's head size).
_QWEN3: dict[str, Any] = {
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
_LLAMA_3: dict[str, Any] = {
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
QWEN3_0_6B: dict[str, Any] = {
    **_QWEN3,
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
# The sizes users run on a CPU, as the benchmarks build them: each family's own layers with
# SmolLM2's 49,152-token vocabulary (the tokenizer the random-weight files carry).
_SMOLLM2_VOCABULARY = SMOLLM2_135M["vocab_size"]
LLAMA_3_2_1B: dict[str, Any] = {
    **_LLAMA_3,
    "vocab_size": _SMOLLM2_VOCABULARY,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
QWEN3_4B: dict[str, Any] = {
    **_QWEN3,
    "vocab_size": _SMOLLM2_VOCABULARY,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
LLAMA_3_1_8B: dict[str, Any] = {
    **_LLAMA_3,
    "vocab_size": _SMOLLM2_VOCABULARY,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
# Their architectures as GGUF names them.
CPU_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("llama", LLAMA_3_2_1B),
    "qwen3-4b": ("qwen3", QWEN3_4B),
    "llama-3.1-8b": ("llama", LLAMA_3_1_8B),
}
