"""llama.cpp in this process: initialised once, with its log routed to ours, for the runner and
the API process's vocabulary-only frontend alike; the context the runner asks for; and the
two thresholds of ggml's CPU attention that the runner's batches are shaped around."""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import llama_cpp as llama

from slotserve.runners.llama_cpp.cpu import BUFFER_LOG
from slotserve.runners.rope import RopeSettings

logger = logging.getLogger(__name__)

_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4

# ggml's CPU flash attention switches to 64-query tiles at 64 queries of one sequence
# (GGML_FA_TILE_Q): the grain of this runner's chunk policy (why: engine/chunk_policy.py).
FA_TILE_Q = 64
# ggml takes its split-KV decode path from 512 KV cells, and llama.cpp pads a stream's cells
# to multiples of 256: a lone query at position 256 or later can take it (margin of one).
SPLIT_KV_CONTEXT = 255


def default_ctx_size(num_slots: int, n_ctx_train: int) -> int:
    """``--ctx-size 0``: every slot gets the trained context, at most 4096 tokens."""
    return num_slots * min(n_ctx_train, 4096)


# ggml's types of each KV cache type llama-server offers (``options.KV_CACHE_TYPES``).
KV_GGML_TYPES = {
    "f32": llama.GGML_TYPE_F32,
    "f16": llama.GGML_TYPE_F16,
    "q8_0": llama.GGML_TYPE_Q8_0,
    "q4_0": llama.GGML_TYPE_Q4_0,
    "q4_1": llama.GGML_TYPE_Q4_1,
    "iq4_nl": llama.GGML_TYPE_IQ4_NL,
    "q5_0": llama.GGML_TYPE_Q5_0,
    "q5_1": llama.GGML_TYPE_Q5_1,
}
_ROPE_SCALING_TYPES = {
    "none": llama.LLAMA_ROPE_SCALING_TYPE_NONE,
    "linear": llama.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "yarn": llama.LLAMA_ROPE_SCALING_TYPE_YARN,
}


def context_params(
    ctx_size: int,
    max_batch_tokens: int,
    num_slots: int,
    threads: int,
    flash_attn: bool,
    rope: RopeSettings,
    kv_types: tuple[str, str],
) -> Any:
    """The runner's context: one KV stream per sequence (``kv_unified = false``; why: the
    runner's docstring), a whole step in one micro-batch, no pooling; ``rope``: RoPE settings
    laid over the file's (each one left unset keeps the file's); ``kv_types``: the KV cache's
    key and value types."""
    params = llama.llama_context_default_params()
    params.n_ctx = ctx_size
    params.n_batch = max_batch_tokens
    params.n_ubatch = max_batch_tokens
    params.n_seq_max = num_slots
    params.kv_unified = False
    params.n_threads = threads
    params.n_threads_batch = threads
    params.no_perf = True
    # Per-token embeddings, pooled by the runner: llama.cpp's own pooling works per batch,
    # while a prompt may span several chunks (runners/pooling.py).
    params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE
    params.flash_attn_type = (
        llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.type_k, params.type_v = (KV_GGML_TYPES[kind] for kind in kv_types)
    if rope.scaling is not None:
        params.rope_scaling_type = _ROPE_SCALING_TYPES[rope.scaling]
    if rope.factor is not None:  # llama.cpp's frequency scale is the stretch's inverse
        params.rope_freq_scale = 1.0 / rope.factor
    if rope.original_context is not None:
        params.yarn_orig_ctx = rope.original_context
    if rope.theta is not None:
        params.rope_freq_base = rope.theta
    if rope.beta_fast is not None:
        params.yarn_beta_fast = rope.beta_fast
    if rope.beta_slow is not None:
        params.yarn_beta_slow = rope.beta_slow
    return params


@functools.cache
def init_llama_backend() -> None:
    """Initialises llama.cpp once per process, with its logging routed to ours."""
    llama.llama_log_set(_silence_log, ctypes.c_void_p(0))
    llama.llama_backend_init()


@llama.llama_log_callback  # type: ignore[untyped-decorator]
def _silence_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Routes llama.cpp's warnings and errors to our logger; drops its chatty info lines but
    for the weight buffers a load reports."""
    message = text.decode("utf-8", errors="replace").rstrip()
    BUFFER_LOG.feed(message)
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and message:
        logger.log(
            logging.WARNING if level == _GGML_LOG_WARN else logging.ERROR,
            "llama.cpp: %s",
            message,
        )


def check_gpu_offload(n_gpu_layers: int) -> None:
    """Raises ``ValueError`` for layers to offload where this llama-cpp-python build cannot."""
    if n_gpu_layers and not llama.llama_supports_gpu_offload():
        raise ValueError(
            "--n-gpu-layers needs llama-cpp-python built with a GPU backend, and this build "
            'is CPU-only: reinstall it with CMAKE_ARGS="-DGGML_CUDA=on" pip install '
            "--force-reinstall --no-cache-dir llama-cpp-python (docs/runners.md)"
        )
