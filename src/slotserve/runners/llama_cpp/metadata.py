"""A GGUF's metadata as llama.cpp reads it: what the runner and the API process's memory
estimate need of the model's shape. Read from the key-value metadata only, so a
``vocab_only`` load (no weights) answers as well as a full one."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp as llama

from slotserve.engine.sampling_defaults import LLAMA_SERVER, SamplingDefaults, from_gguf

# Bytes of a block of values, and its values, of each KV cache type (ggml's blocks).
KV_TYPE_BLOCKS = {
    "f32": (4, 1),
    "f16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "iq4_nl": (18, 32),
    "q5_0": (22, 32),
    "q5_1": (24, 32),
}


def metadata(model: Any, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(256)
    if llama.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer)) < 0:
        return None
    return buffer.value.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class KvShape:
    """Bytes of K and V one token takes over all layers, the trained context, the layers."""

    bytes_per_token: int
    n_ctx_train: int
    n_layer: int


def kv_shape(model: Any, type_k: str, type_v: str) -> KvShape:
    """The shape of the model's KV cache with keys of ``type_k`` and values of ``type_v``."""
    arch = metadata(model, "general.architecture")
    if arch is None:
        raise RuntimeError("the GGUF names no architecture")

    def number(suffix: str) -> int | None:
        value = metadata(model, f"{arch}.{suffix}")
        try:
            return int(value) if value is not None else None
        except ValueError:  # an array (per-layer values): not a single number
            return None

    n_layer = number("block_count") or 0
    n_head = number("attention.head_count") or 1
    n_head_kv = number("attention.head_count_kv") or n_head
    key_length = number("attention.key_length") or (number("embedding_length") or 0) // n_head
    value_length = number("attention.value_length") or key_length

    def row_bytes(values: int, kind: str) -> int:  # in whole blocks
        block_bytes, block_values = KV_TYPE_BLOCKS[kind]
        return -(-values // block_values) * block_bytes

    per_head = row_bytes(key_length, type_k) + row_bytes(value_length, type_v)
    return KvShape(n_layer * n_head_kv * per_head, number("context_length") or 4096, n_layer)


def sampling_defaults(model: Any) -> SamplingDefaults:
    """The GGUF's recommended sampling (``general.sampling.*``) over llama-server's defaults,
    which the model's users on llama.cpp know."""
    return from_gguf(lambda key: metadata(model, key)).over(LLAMA_SERVER)


# llama.cpp's enum llama_pooling_type, as GGUFs store it in ``<arch>.pooling_type``.
_GGUF_POOLING = {"1": "mean", "2": "cls", "3": "last"}


def pooling_of(model: Any) -> str:
    """How the model pools a prompt into an embedding: the GGUF's ``<arch>.pooling_type`` when
    it names mean, first-token or last-token pooling, else the last token's (what a causal
    model's final hidden state sums up). Encoders are refused: this runner keeps KV per
    sequence and computes prompts in causal chunks."""
    arch = metadata(model, "general.architecture")
    if metadata(model, f"{arch}.attention.causal") == "false":
        raise RuntimeError(
            f"the GGUF's {arch} model is an encoder (bidirectional attention), which the "
            "llama.cpp runner does not serve; serve its HF folder with --runner torch"
        )
    return _GGUF_POOLING.get(metadata(model, f"{arch}.pooling_type") or "", "last")
