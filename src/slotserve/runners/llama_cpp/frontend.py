"""What the API process keeps of a GGUF model when the llama.cpp runner lives in the engine
process: its vocabulary alone (llama.cpp's ``vocab_only`` load reads no weights), for the
tokenizer; and the memory a runner of it will take, read from the same cheap load."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as llama

from slotserve.engine.memory_need import MemoryNeed
from slotserve.runners.llama_cpp.backend import default_ctx_size, init_llama_backend
from slotserve.runners.llama_cpp.metadata import kv_shape
from slotserve.runners.llama_cpp.tokenizer import LlamaCppTokenizer
from slotserve.runners.options import LlamaCppConfig


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


COMPUTE_BUFFER_BYTES = 128 * 2**20


def estimate_memory(
    model_path: Path,
    num_slots: int,
    ctx_size: int,
    max_batch_tokens: int,
    n_gpu_layers: int = 0,
    kv_types: tuple[str, str] = (LlamaCppConfig.cache_type_k, LlamaCppConfig.cache_type_v),
) -> MemoryNeed:
    """Weights (the file, memory-mapped), the KV cache of every slot's context (keys and
    values of ``kv_types``) and the compute buffers, from the GGUF's metadata (a
    ``vocab_only`` load: no weight is read); offloaded layers (``n_gpu_layers``, -1: all)
    hold their share of both on the GPU."""
    init_llama_backend()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    model = llama.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read the GGUF metadata of {model_path}")
    try:
        shape = kv_shape(model, *kv_types)
        n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    except RuntimeError as exc:
        raise RuntimeError(f"{model_path}: {exc}") from None
    finally:
        llama.llama_model_free(model)
    tokens = ctx_size if ctx_size > 0 else default_ctx_size(num_slots, shape.n_ctx_train)
    layers = max(shape.n_layer, 1)
    offloaded = layers if n_gpu_layers < 0 else min(n_gpu_layers, layers)
    return MemoryNeed(
        weights_bytes=model_path.stat().st_size,
        kv_bytes=shape.bytes_per_token * tokens,
        kv_tokens=tokens,
        overhead_bytes=COMPUTE_BUFFER_BYTES + max_batch_tokens * n_vocab * 4,
        device_share=offloaded / layers,
    )
