"""Picklable recipes for the runners (``engine.runner_interface.RunnerSpec``): the engine
process is started with one and builds its runner from it; the API process asks it for the
frontend it keeps (tokenizer, structured-output check). Imports of a backend happen only when
its recipe is used, so a llama.cpp server never imports torch.

A recipe is its runner's options (``options.py``: declared once, defaults and bounds there)
with what the server adds: the model, its name, the engine's slots and batch, the adapters'
``NAME=PATH`` texts parsed, and the recurrent-state snapshots hosting resolved."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slotserve.engine.config import EngineConfig
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.runner_interface import Runner, RunnerFrontend
from slotserve.options import check_declared, declared_as
from slotserve.runners.options import LlamaCppConfig
from slotserve.runners.rope import llama_cpp_rope

if TYPE_CHECKING:
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig


@dataclass(frozen=True)
class LlamaCppSpec(LlamaCppConfig):
    model_path: Path
    model_name: str | None = None
    num_slots: int = declared_as(EngineConfig, "num_slots")
    max_batch_tokens: int = declared_as(EngineConfig, "max_batch_tokens")
    # (name, GGUF adapter file) of each --lora-modules text.
    lora_modules: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_declared(self)
        llama_cpp_rope(self)  # a usage error here, before any process starts
        if self.cache_type_v not in ("f16", "f32") and not self.flash_attn:
            raise ValueError(
                f"--cache-type-v {self.cache_type_v}: llama.cpp reads a quantized value cache "
                "only with flash attention; drop --no-flash-attn"
            )
        if self.n_gpu_layers:  # refused before any process starts, on a CPU-only build
            from slotserve.runners.llama_cpp.backend import check_gpu_offload

            check_gpu_offload(self.n_gpu_layers)

    def __call__(self) -> Runner:
        from slotserve.runners.llama_cpp.runner import LlamaCppRunner

        return LlamaCppRunner(
            self.model_path,
            self.num_slots,
            self.ctx_size,
            self.max_batch_tokens,
            n_threads=self.threads or None,
            flash_attn=self.flash_attn,
            model_name=self.model_name,
            state_snapshots=self.prefix_cache_snapshots or 0,
            repack=self.repack,
            lora_modules=self.lora_modules,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            n_gpu_layers=self.n_gpu_layers,
            rope=llama_cpp_rope(self),
            kv_types=(self.cache_type_k, self.cache_type_v),
        )

    def frontend(self) -> RunnerFrontend:
        from slotserve.runners.llama_cpp.frontend import LlamaCppFrontend

        return LlamaCppFrontend(self.model_path)

    def memory_needed(self) -> MemoryNeed:
        from slotserve.runners.llama_cpp.frontend import estimate_memory

        kv_types = (self.cache_type_k, self.cache_type_v)
        sizes = (self.num_slots, self.ctx_size, self.max_batch_tokens)
        return estimate_memory(self.model_path, *sizes, self.n_gpu_layers, kv_types)


@dataclass(frozen=True)
class TorchSpec:
    load: TorchLoadConfig

    def __call__(self) -> Runner:
        from slotserve.runners.pytorch.encoder.runner import EncoderRunner, is_encoder
        from slotserve.runners.pytorch.runner import TorchRunner

        if is_encoder(self.load.model_path):
            return EncoderRunner(self.load)
        return TorchRunner(self.load)

    def frontend(self) -> RunnerFrontend:
        from slotserve.runners.pytorch.runner import TorchFrontend

        return TorchFrontend(self.load.model_path)

    def memory_needed(self) -> MemoryNeed:
        from slotserve.runners.pytorch.encoder.runner import estimate_encoder_memory, is_encoder
        from slotserve.runners.pytorch.load.memory import estimate_memory

        if is_encoder(self.load.model_path):
            return estimate_encoder_memory(self.load)
        return estimate_memory(self.load)
