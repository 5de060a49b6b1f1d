"""How the PyTorch runner is built (its recipe, ``runners/specs.py``: ``TorchSpec``): the
``TorchConfig`` options as the server was given them, declared once in ``runners/options.py``
(each default, bound and help there), with what the server adds. Checked before any weight
is read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slotserve.engine.config import EngineConfig
from slotserve.options import check_declared, declared_as
from slotserve.runners.options import DTYPES, TorchConfig
from slotserve.runners.rope import torch_overrides

NO_CPU_KERNELS = "the CPU kernels do not serve this load (bfloat16, --cpu-kernels, head size)"
# --dtype's choices as torch's types ("auto" is bfloat16, or float32 for an encoder).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPES if name != "auto"
}


@dataclass(frozen=True)
class TorchLoadConfig(TorchConfig):
    """``prefix_cache_snapshots`` is the number hosting resolved (``hosting/launch.py``: the
    option's default, 4 per slot, or 0 without a prefix cache); None, given in code, is none."""

    model_path: Path  # an HF folder or a .gguf file
    model_name: str | None = None
    num_slots: int = declared_as(EngineConfig, "num_slots")
    max_batch_tokens: int = declared_as(EngineConfig, "max_batch_tokens")
    # (name, PEFT folder) of each --lora-modules text.
    lora_modules: tuple[tuple[str, str], ...] = field(  # type: ignore[assignment]
        default=(), kw_only=True
    )

    def __post_init__(self) -> None:
        check_declared(self)
        torch_overrides(self)  # a usage error here, before any process starts
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("--gpu-memory-fraction must be in (0, 1]")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} --lora-modules, over --max-loras")
        if self.tensor_parallel_size > 1:
            for flag, given in (
                ("LoRA adapters are", self.lora_modules),
                ("--batch-invariant is", self.batch_invariant),
                ("--classifier-from-token is", self.classifier_from_token),
            ):
                if given:
                    raise ValueError(f"{flag} not served under tensor parallelism")

    @property
    def model_overrides(self) -> str | None:
        """``--hf-overrides`` with llama-server's RoPE flags joined, as HF names them."""
        return torch_overrides(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES["bfloat16" if self.dtype == "auto" else self.dtype]

    def quantized_kernels_refusal(self) -> str | None:
        """Why weights cannot stay quantized in this load, from its options alone (None: they
        can, where the CPU kernels load and take the model's head size: ``NO_CPU_KERNELS``
        else)."""
        if self.torch_device.type != "cpu":
            return "the quantized kernels are the CPU's"
        if self.tensor_parallel_size > 1:
            return "not under tensor parallelism"
        if self.batch_invariant:
            return "--batch-invariant runs the Triton matmuls"
        if not self.cpu_kernels or self.torch_dtype != torch.bfloat16:
            return NO_CPU_KERNELS
        return None

    @property
    def kv_int8(self) -> bool:
        """Whether the KV pool holds int8 rows (``--kv-cache-dtype int8``)."""
        return self.kv_cache_dtype == "int8"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def rank_threads(self) -> int:
        """``--threads`` for each tensor-parallel rank, else the cores shared evenly."""
        return self.threads or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)

    @property
    def snapshots(self) -> int:
        """Recurrent-state snapshots the prefix cache may keep (Gated DeltaNet models)."""
        return self.prefix_cache_snapshots or 0

    def sequence_length(self, trained_context: int) -> int:
        """Tokens one sequence may hold: ``--max-model-len`` (past the trained context too, as
        llama.cpp allows: the load warns), else the trained context up to 4096."""
        if self.max_model_len > trained_context:
            return self.max_model_len
        return min(trained_context, self.max_model_len or 4096)
