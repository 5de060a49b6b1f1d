"""Picklable recipes for the runners (``engine.runner_interface.RunnerSpec``): the engine
process is started with one and builds its runner from it; the API process asks it for the
frontend it keeps (tokenizer, structured-output check). Imports of a backend happen only when
its recipe is used, so a llama.cpp server never imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.runner_interface import Runner, RunnerFrontend

if TYPE_CHECKING:
    from slotserve.runners.pytorch.load.checkpoint import TorchLoadConfig


@dataclass(frozen=True)
class LlamaCppSpec:
    model_path: Path
    num_slots: int
    ctx_size: int
    max_batch_tokens: int
    n_threads: int | None = None
    flash_attn: bool = True
    model_name: str | None = None
    state_snapshots: int = 0
    repack: str = "auto"
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 8
    max_lora_rank: int = 64
    n_gpu_layers: int = 0

    def __post_init__(self) -> None:
        if self.n_gpu_layers:  # refused before any process starts, on a CPU-only build
            from slotserve.runners.llama_cpp.backend import check_gpu_offload

            check_gpu_offload(self.n_gpu_layers)

    def __call__(self) -> Runner:
        from slotserve.runners.llama_cpp.runner import LlamaCppRunner

        return LlamaCppRunner(**vars(self))  # the recipe's fields are the runner's arguments

    def frontend(self) -> RunnerFrontend:
        from slotserve.runners.llama_cpp.frontend import LlamaCppFrontend

        return LlamaCppFrontend(self.model_path)

    def memory_needed(self) -> MemoryNeed:
        from slotserve.runners.llama_cpp.frontend import estimate_memory

        return estimate_memory(
            self.model_path, self.num_slots, self.ctx_size, self.max_batch_tokens, self.n_gpu_layers
        )


@dataclass(frozen=True)
class TorchSpec:
    load: TorchLoadConfig

    def __call__(self) -> Runner:
        from slotserve.runners.pytorch.encoder import EncoderRunner, is_encoder
        from slotserve.runners.pytorch.runner import TorchRunner

        if is_encoder(self.load.model_path):
            return EncoderRunner(self.load)
        return TorchRunner(self.load)

    def frontend(self) -> RunnerFrontend:
        from slotserve.runners.pytorch.runner import TorchFrontend

        return TorchFrontend(self.load.model_path)

    def memory_needed(self) -> MemoryNeed:
        from slotserve.runners.pytorch.encoder import estimate_encoder_memory, is_encoder
        from slotserve.runners.pytorch.load.memory import estimate_memory

        if is_encoder(self.load.model_path):
            return estimate_encoder_memory(self.load)
        return estimate_memory(self.load)
