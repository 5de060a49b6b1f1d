"""What the API process keeps of a GGUF model when the llama.cpp runner lives in the engine
process: its vocabulary alone (llama.cpp's ``vocab_only`` load reads no weights), for the
tokenizer; and the memory a runner of it will take, read from the same cheap load."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as llama

from slotserve.engine.runner_interface import MemoryNeed
from slotserve.runners.llama_cpp_runner import default_ctx_size, init_llama_backend
from slotserve.runners.llama_cpp_tokenizer import LlamaCppTokenizer


class LlamaCppFrontend:
    def __init__(self, model_path: Path) -> None:
        init_llama_backend()
        params = llama.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(model_path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {model_path}")
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._tokenizer = LlamaCppTokenizer(self._vocab)

    @property
    def tokenizer(self) -> LlamaCppTokenizer:
        return self._tokenizer

    def close(self) -> None:
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None


KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV type is f16
COMPUTE_BUFFER_BYTES = 128 * 2**20


def estimate_memory(
    model_path: Path, num_slots: int, ctx_size: int, max_batch_tokens: int
) -> MemoryNeed:
    """Weights (the file, memory-mapped), the KV cache of every slot's context and the
    compute buffers, from the GGUF's metadata (a ``vocab_only`` load: no weight is read)."""
    init_llama_backend()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    model = llama.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read the GGUF metadata of {model_path}")
    try:
        buffer = ctypes.create_string_buffer(256)

        def meta(key: str) -> int | None:
            if llama.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer)) < 0:
                return None
            try:
                return int(buffer.value.decode())
            except ValueError:  # an array (per-layer values): not a single number
                return None

        if llama.llama_model_meta_val_str(model, b"general.architecture", buffer, 256) < 0:
            raise RuntimeError(f"{model_path} names no architecture")
        arch = buffer.value.decode()
        n_layer = meta(f"{arch}.block_count") or 0
        n_head = meta(f"{arch}.attention.head_count") or 1
        n_head_kv = meta(f"{arch}.attention.head_count_kv") or n_head
        n_embd = meta(f"{arch}.embedding_length") or 0
        key_length = meta(f"{arch}.attention.key_length") or n_embd // n_head
        value_length = meta(f"{arch}.attention.value_length") or key_length
        n_ctx_train = meta(f"{arch}.context_length") or 4096
        n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    finally:
        llama.llama_model_free(model)
    tokens = ctx_size if ctx_size > 0 else default_ctx_size(num_slots, n_ctx_train)
    per_token = n_layer * n_head_kv * (key_length + value_length) * KV_BYTES_PER_VALUE
    return MemoryNeed(
        weights_bytes=model_path.stat().st_size,
        kv_bytes=per_token * tokens,
        kv_tokens=tokens,
        overhead_bytes=COMPUTE_BUFFER_BYTES + max_batch_tokens * n_vocab * 4,
    )
