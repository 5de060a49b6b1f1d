"""What the PyTorch runner reads before any weight: its load settings, the checkpoint's
configuration (an HF ``config.json`` or GGUF metadata), and the memory the runner will take
(the server's pre-flight before loading a model)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.runner_interface import MemoryNeed
from slotserve.engine.sampling_defaults import (
    NEUTRAL,
    SamplingDefaults,
    from_generation_config,
    from_gguf,
)
from slotserve.runners.pytorch.config import ModelConfig, UnsupportedModelError, config_from_hf
from slotserve.runners.pytorch.tensor_parallel import shard_config

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TorchLoadConfig:
    """How to build the runner; validated before any weight is read."""

    model_path: Path  # an HF folder or a .gguf file
    num_slots: int = 8
    max_batch_tokens: int = 512
    dtype: str = "auto"  # auto: bfloat16 (batch-invariant kernels on CPU; fast on GPUs)
    device: str = "auto"  # auto: cuda when available, else cpu
    load_format: str = "auto"  # auto | dummy (random weights of the config)
    max_seq_len: int = 0  # 0: min(trained context, 4096)
    kv_memory_bytes: int = 0  # 0: every slot's max_seq_len, within a quarter of RAM (CPU)
    gpu_memory_fraction: float = 0.9
    block_size: int = 16
    threads: int = 0  # per tensor-parallel rank; 0: the cores shared evenly between ranks
    model_name: str | None = None
    tensor_parallel_size: int = 1  # ranks, each a slice of every layer (tensor_parallel.py)
    cpu_kernels: bool = True  # CPU, bfloat16: the C++ kernels (cpu_kernels.py) where they run
    # Gated DeltaNet models: recurrent states the prefix cache may keep (0: no prefix cache).
    state_snapshots: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("--load-format must be auto or dummy")
        if self.block_size < 1 or self.num_slots < 1:
            raise ValueError("block size and slots must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("--gpu-memory-fraction must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.state_snapshots < 0:
            raise ValueError("--prefix-cache-snapshots must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES["bfloat16" if self.dtype == "auto" else self.dtype]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def sequence_length(self, config: ModelConfig) -> int:
        """Tokens one sequence may hold: ``--max-model-len``, else the trained context up
        to 4096."""
        return min(config.max_position_embeddings, self.max_seq_len or 4096)


def read_model_config(path: Path, gguf_reader: Any = None) -> ModelConfig:
    """The checkpoint's configuration, checked, without reading a weight (a GGUF file's
    ``GGUFReader`` may be passed in: opening one parses the whole header, ~2 s here)."""
    name = path.stem if path.is_file() else path.name
    if path.is_file():
        return config_from_gguf(gguf_metadata(gguf_reader or open_gguf(path)), name)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return config_from_hf(json.loads(config_file.read_text()), name)


def sampling_defaults(path: Path, gguf_reader: Any = None) -> SamplingDefaults:
    """The checkpoint's recommended sampling (``generation_config.json`` beside
    ``config.json``, or a GGUF's ``general.sampling.*`` keys) over vLLM's neutral defaults, as
    vLLM's ``--generation-config auto`` applies them."""
    if path.is_file():
        fields = (gguf_reader or open_gguf(path)).fields
        own = from_gguf(lambda key: fields[key].contents() if key in fields else None)
        return own.over(NEUTRAL)
    config_file = path / "generation_config.json"
    try:
        raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError) as exc:
        # Only advice: a broken file must not stop the model from serving.
        logger.warning("ignoring %s: %s", config_file, exc)
        raw = {}
    own = from_generation_config(raw) if isinstance(raw, dict) else SamplingDefaults()
    return own.over(NEUTRAL)


def cpu_kv_budget(load: TorchLoadConfig, max_seq_len: int, bytes_per_token: int) -> int:
    """KV bytes on CPU: ``--kv-memory``, else every slot's ``max_seq_len`` within a quarter of
    RAM."""
    if load.kv_memory_bytes:
        return load.kv_memory_bytes
    blocks_per_sequence = -(-max_seq_len // load.block_size)  # whole blocks, rounded up
    wanted = load.num_slots * blocks_per_sequence * load.block_size * bytes_per_token
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(wanted, ram // 4)


def kv_blocks(
    load: TorchLoadConfig, device: torch.device, max_seq_len: int, bytes_per_token: int
) -> int:
    """KV pool blocks: ``--kv-memory``; on a GPU what ``--gpu-memory-fraction`` leaves free
    after the weights (and any recurrent state); on CPU :func:`cpu_kv_budget`."""
    block = load.block_size
    if load.kv_memory_bytes:
        budget = load.kv_memory_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(free - total * (1 - load.gpu_memory_fraction))
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
    config = read_model_config(load.model_path)
    ranks = load.tensor_parallel_size
    shard_config(config, ranks)  # refused here, before any weight, when heads do not divide
    dtype_bytes = load.torch_dtype.itemsize
    max_seq_len = load.sequence_length(config)
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
    weights = (embeddings + layers) * dtype_bytes
    per_token = config.kv_bytes_per_token(dtype_bytes)
    on_gpu = load.torch_device().type == "cuda"
    if on_gpu and not load.kv_memory_bytes:
        kv = max_seq_len * per_token
    else:
        kv = cpu_kv_budget(load, max_seq_len, per_token)
        if load.kv_memory_bytes:
            kv *= ranks
    buffers = load.max_batch_tokens * config.vocab_size * 4 + ranks * 128 * 2**20
    # DeltaNet states: the slots' and the prefix cache's snapshots.
    buffers += (load.num_slots + load.state_snapshots) * config.linear_state_bytes(dtype_bytes)
    return MemoryNeed(weights, kv, kv // per_token, buffers, gpu=on_gpu)


def open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_metadata(reader: object) -> dict[str, object]:
    """GGUF key/value metadata as plain Python values (and the tensor names)."""
    metadata: dict[str, object] = {}
    for key, field in reader.fields.items():  # type: ignore[attr-defined]
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            continue  # the vocabulary: large, and the tokenizer reads it itself
        try:
            metadata[key] = field.contents()
        except Exception:  # a field type this reader cannot turn into Python values
            continue
    metadata["_tensor_names"] = [t.name for t in reader.tensors]  # type: ignore[attr-defined]
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # type: ignore[attr-defined]
    if tokens is not None:
        metadata["_vocab_tokens"] = len(tokens.data)
    return metadata


# GGUF architecture name → HF model_type; llama.cpp converts Mistral as "llama".
_GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "gemma3": "gemma3_text",
}


def config_from_gguf(metadata: Mapping[str, Any], name: str) -> ModelConfig:
    """The same, from GGUF metadata (``general.architecture`` and ``<arch>.*`` keys)."""
    arch = str(metadata.get("general.architecture"))
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name}: GGUF architecture {arch!r} is not supported by the PyTorch runner "
            f"(supported: {', '.join(sorted(_GGUF_ARCHITECTURES))}); serve this file with "
            "the llama.cpp runner (--runner llama.cpp, the default for a .gguf)"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"{name}: GGUF metadata has no {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = metadata.get(f"{arch}.vocab_size") or metadata.get("_vocab_tokens")
    if not vocab:
        raise UnsupportedModelError(f"{name}: GGUF metadata gives no vocabulary size")
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    raw: dict[str, Any] = {
        "model_type": _GGUF_ARCHITECTURES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0 if experts else None)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in metadata.get("_tensor_names", ()),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    scaling_kind = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_kind == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if arch == "qwen3moe":
        # llama.cpp's graph renormalises the top-k weights and makes every layer sparse.
        used = int(get("expert_used_count"))
        raw |= {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": int(
                get("expert_feed_forward_length", int(raw["intermediate_size"]) // used)
            ),
            "norm_topk_prob": True,
        }
    if arch in ("qwen35", "qwen35moe"):
        # llama.cpp's converter keeps the DeltaNet sizes under its SSM keys.
        value_heads = int(get("ssm.time_step_rank"))
        raw |= {
            "linear_num_key_heads": int(get("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_key_head_dim": int(get("ssm.state_size")),
            "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
            "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
            "full_attention_interval": int(get("full_attention_interval", 4)),
            "rotary_dim": int(get("rope.dimension_count", int(raw["head_dim"]) // 4)),
        }
    if arch == "qwen35moe":
        raw |= {
            "num_experts": experts,
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
        }
    if arch == "gemma3":
        window = int(get("attention.sliding_window"))
        raw |= {
            "sliding_window": window,
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": int(get("attention.key_length", hidden // heads)),
            "hidden_activation": "gelu_pytorch_tanh",
        }
    return config_from_hf(raw, name)
