"""The memory the PyTorch runner takes: its KV pool's blocks, and the estimate of the server's
pre-flight before loading a model, from the configuration alone."""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from slotserve.engine.memory_need import MemoryNeed
from slotserve.runners.pytorch.load.checkpoint import Checkpoint, open_checkpoint
from slotserve.runners.pytorch.load.format_choice import QUANTIZED_TYPES
from slotserve.runners.pytorch.load.quant_weights import DENSE_AS
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.tensor_parallel import shard_config
from slotserve.runners.pytorch.quant.formats import FORMATS, GROUP, QuantKind
from slotserve.runners.pytorch.quant.tensor import QUANTIZE_TO

# A checkpoint kept as its own blocks takes about its bytes on disk: a GGUF file's packed records
# are within 1.1 of it; a 4-bit folder's blocks 1.12 (Q4_ZP) to 1.3 (Q5_0) of its 4.25 bits.
STORED_GROWTH = 1.3


def cpu_kv_budget(load: TorchLoadConfig, max_seq_len: int, bytes_per_token: int) -> int:
    """KV bytes on CPU: ``--kv-memory``, else every slot's ``max_seq_len`` within a quarter of
    RAM."""
    if load.kv_memory:
        return load.kv_memory
    blocks_per_sequence = -(-max_seq_len // load.block_size)  # whole blocks, rounded up
    wanted = load.num_slots * blocks_per_sequence * load.block_size * bytes_per_token
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(wanted, ram // 4)


def decode_graph_bytes(config: ModelConfig, max_batch: int, dtype_bytes: int) -> int:
    """What decode's CUDA graphs hold (``shard/cuda_graphs.py``), at most: the largest bucket's
    logits (the head's output and its float32 copy, twice over for the softmax's temporaries)
    and a few layers' activations, plus the captures' own bookkeeping."""
    logits = config.vocab_size * (dtype_bytes + 3 * 4)
    q_dim = config.num_heads * config.head_dim * (2 if config.attn_output_gate else 1)
    activations = 8 * (config.hidden_size + config.intermediate_size + q_dim) * dtype_bytes
    return max_batch * (logits + activations) + 64 * 2**20


def kv_blocks(
    load: TorchLoadConfig,
    device: torch.device,
    max_seq_len: int,
    bytes_per_token: int,
    reserved: int = 0,
) -> int:
    """KV pool blocks: ``--kv-memory``; on a GPU what ``--gpu-memory-fraction`` leaves free
    after the weights (and any recurrent state) and the ``reserved`` bytes (decode graphs); on
    CPU :func:`cpu_kv_budget`."""
    block = load.block_size
    if load.kv_memory:
        budget = load.kv_memory
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(free - total * (1 - load.gpu_memory_fraction)) - reserved
    else:
        budget = cpu_kv_budget(load, max_seq_len, bytes_per_token)
    blocks = budget // (block * bytes_per_token)
    if blocks * block < max_seq_len:
        raise ValueError(
            f"the KV memory ({budget / 2**20:.0f} MiB) holds {blocks * block} tokens, "
            f"less than one sequence of {max_seq_len}: raise --kv-memory or lower "
            f"--max-model-len"
        )
    return int(blocks)


def estimate_memory(load: TorchLoadConfig) -> MemoryNeed:
    """Weights in the runner's dtype, the KV pool and buffers, from the configuration alone
    (unsupported architectures fail here, before any weight is read). On a GPU the KV pool
    takes what ``--gpu-memory-fraction`` leaves; at least one sequence of it must fit. Tensor
    parallel ranks on one machine: their slices add up to the whole model, each rank a process
    of its own (``--kv-memory`` is each rank's)."""
    checkpoint = open_checkpoint(load.model_path, load.model_overrides)
    config = checkpoint.config
    ranks = load.tensor_parallel_size
    shard_config(config, ranks)  # refused here, before any weight, when heads do not divide
    dtype_bytes = load.torch_dtype.itemsize
    max_seq_len = load.sequence_length(config.max_position_embeddings)
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    attention = hidden * ((3 if config.attn_output_gate else 2) * q_dim + 2 * kv_dim)
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    linear = hidden * (
        config.linear_conv_channels + 2 * value_dim + 2 * config.linear_num_value_heads
    )
    dense = 3 * hidden * config.intermediate_size
    experts = config.num_experts * (3 * hidden * config.moe_intermediate_size + hidden)
    experts += (3 * hidden + 1) * config.shared_expert_intermediate_size
    layers = sum(
        (linear if config.is_linear(i) else attention) + (experts if config.is_sparse(i) else dense)
        for i in range(config.num_layers)
    )
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    weights = _weight_bytes(load, checkpoint, embeddings, layers)
    per_token = config.kv_bytes_per_token(dtype_bytes, load.kv_int8)
    on_gpu = load.torch_device.type == "cuda"
    if on_gpu and not load.kv_memory:
        kv = max_seq_len * per_token
    else:
        kv = cpu_kv_budget(load, max_seq_len, per_token)
        if load.kv_memory:
            kv *= ranks
    buffers = load.max_batch_tokens * config.vocab_size * 4 + ranks * 128 * 2**20
    if on_gpu and not load.enforce_eager:
        buffers += decode_graph_bytes(config, load.num_slots, dtype_bytes)
    # DeltaNet states: the slots' and the prefix cache's snapshots.
    buffers += (load.num_slots + load.snapshots) * config.linear_state_bytes(dtype_bytes)
    return MemoryNeed(weights, kv, kv // per_token, buffers, device_share=float(on_gpu))


def _weight_bytes(
    load: TorchLoadConfig, checkpoint: Checkpoint, embeddings: int, layers: int
) -> int:
    """What the weights will take: in the model's dtype, or kept quantized where the load keeps
    them so (``TorchLoadConfig.quantized_kernels_refusal``: on CPU in bfloat16, one rank):
    a quantized checkpoint about its bytes on disk, an HF one rounded by ``--quantization``
    at its type's bytes a weight (the embedding and LM head at Q8_0's)."""
    dense = (embeddings + layers) * load.torch_dtype.itemsize
    if load.quantized_kernels_refusal() is not None:
        return dense
    if load.quantization in QUANTIZE_TO:
        return round(
            layers * _bytes_a_weight(QUANTIZE_TO[load.quantization])
            + embeddings * _bytes_a_weight(DENSE_AS)
        )
    if load.quantization == "none" or not checkpoint.quantized_types() & QUANTIZED_TYPES:
        return dense
    path = checkpoint.path
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return round(STORED_GROWTH * sum(f.stat().st_size for f in files))


def _bytes_a_weight(kind: QuantKind) -> float:
    f = FORMATS[kind]
    return f.record_bytes / (GROUP * f.super)


def return_freed_memory() -> None:
    """glibc keeps the small allocations a load frees (the quantized packing's chunks, a
    tokenizer's scratch) for reuse; handed back, the resident memory is what the model holds.
    Nothing where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
