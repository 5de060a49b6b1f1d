"""What the llama.cpp runner tells the engine about a loaded model (its ``ModelInfo``): limits,
tokens, chunk policy, what the prefix cache and speculation can do with it, and which weight
layouts and CPU features serve it."""

from __future__ import annotations

from typing import Any

import llama_cpp as llama

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.runner_interface import (
    RECURRENT_STATE_NO_ROLLBACK,
    AdapterInfo,
    ComputePath,
    ModelInfo,
)
from slotserve.engine.verify_cost import VerifyCost
from slotserve.runners.llama_cpp.backend import FA_TILE_Q, SPLIT_KV_CONTEXT
from slotserve.runners.llama_cpp.cpu import WeightLayout, cpu_features
from slotserve.runners.llama_cpp.metadata import kv_shape, sampling_defaults
from slotserve.runners.llama_cpp.tokenizer import LlamaCppTokenizer


def describe(
    model: Any,
    ctx: Any,
    tokenizer: LlamaCppTokenizer,
    *,
    name: str,
    num_slots: int,
    snapshots: int,
    pooling: str,
    buffers: list[str],
    layout: WeightLayout,
    adapters: tuple[AdapterInfo, ...],
    kv_types: tuple[str, str],
) -> ModelInfo:
    """The model's ``ModelInfo``; ``snapshots`` is how many recurrent-state snapshots the
    runner keeps, ``buffers`` the weight buffer types llama.cpp reported while loading,
    ``adapters`` the LoRA adapters loaded with it, ``kv_types`` its KV cache's key and value
    types."""
    vocab = llama.llama_model_get_vocab(model)
    hybrid = bool(llama.llama_model_is_hybrid(model))
    template = llama.llama_model_chat_template(model, None)
    return ModelInfo(
        name=name,
        vocab_size=tokenizer.vocab_size,
        num_slots=num_slots,
        max_seq_len=llama.llama_n_ctx_seq(ctx),
        eog_token_ids=tokenizer.eog_token_ids,
        chat_template=template.decode("utf-8") if template else None,
        bos_token=tokenizer.special_token_text(llama.llama_vocab_bos(vocab)),
        eos_token=tokenizer.special_token_text(llama.llama_vocab_eos(vocab)),
        runner="llama.cpp",
        chunk_policy=ChunkPolicy(
            grain=FA_TILE_Q,
            equal_chunks=True,
            anchored=hybrid,
            odd_part_alone=hybrid,
        ),
        kv_bytes_per_token=kv_shape(model, *kv_types).bytes_per_token,
        prefix_cache_unsupported=_why_no_prefix_sharing(model, hybrid, snapshots),
        speculative_unsupported=(
            RECURRENT_STATE_NO_ROLLBACK if llama.llama_model_is_recurrent(model) or hybrid else None
        ),
        # ggml's CPU matmuls for these quantised types cost about as much per token in a
        # chunk as alone: each draft adds half a step (benchmarks/verify_cost.py). A lone
        # decode past SPLIT_KV_CONTEXT carries a ballast token a first draft can replace.
        verify_cost=VerifyCost(0.39, 0.5, SPLIT_KV_CONTEXT if num_slots > 1 else None),
        sampling_defaults=sampling_defaults(model),
        pooling=pooling,
        compute=ComputePath(
            cpu_features=cpu_features(),
            kernels=f"ggml; weights in {', '.join(buffers) or 'no'} buffers "
            f"(extra buffer types {'on' if layout.use_extra_buffers else 'off'}: "
            f"{layout.reason})",
        ),
        lora_unsupported=None,
        adapters=adapters,
    )


def _why_no_prefix_sharing(model: Any, hybrid: bool, snapshots: int) -> str | None:
    if hybrid and not snapshots:
        return (
            "the model's recurrent layers keep a state, which the cache keeps only as "
            "snapshots, and --prefix-cache-snapshots is 0"
        )
    if llama.llama_model_is_recurrent(model) and not hybrid:
        return "the model keeps recurrent state, which cannot be shared by position range"
    if llama.llama_model_n_swa(model) > 0:
        return "sliding-window layers discard early positions, so a prefix cannot be reused"
    return None
