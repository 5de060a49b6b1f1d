"""What the PyTorch runner reads before any weight: its load settings, the checkpoint's
configuration (an HF ``config.json`` or GGUF metadata, read by its family) and its recommended
sampling."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.sampling_defaults import (
    NEUTRAL,
    SamplingDefaults,
    from_generation_config,
    from_gguf,
)
from slotserve.runners.pytorch.families.registry import config_from_gguf, config_from_hf
from slotserve.runners.pytorch.load.gguf_file import gguf_metadata, open_gguf
from slotserve.runners.pytorch.model.config import ModelConfig

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
    # LoRA adapters loaded with the model, (name, PEFT folder); how many may be held at once;
    # the largest rank taken.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 8
    max_lora_rank: int = 64
    # A causal LM served as a reranker, scored by these tokens' logits (``score_head.py``).
    classifier_from_token: tuple[str, ...] = ()
    attention_backend: str = "auto"  # see ``shard.triton_attention``
    # Off the CPU kernels (GPUs): Triton attention and matmuls whose sums keep one order.
    batch_invariant: bool = False
    enforce_eager: bool = False  # GPUs: no CUDA graphs for decode steps (``cuda_graphs.py``)

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
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} --lora-modules, over --max-loras")
        if self.lora_modules and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served under tensor parallelism")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("--batch-invariant is not served under tensor parallelism")
        if self.classifier_from_token and self.tensor_parallel_size > 1:
            raise ValueError("--classifier-from-token is not served under tensor parallelism")

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
    ``GGUFReader`` may be passed in: opening one parses the whole header)."""
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
