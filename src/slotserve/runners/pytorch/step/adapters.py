"""The LoRA adapters the PyTorch runner holds (``--lora-modules``, loaded and unloaded at run
time), at most ``--max-loras`` at once, and each step's rows matched to them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from slotserve.engine.adapters import HeldAdapters
from slotserve.engine.runner_interface import AdapterInfo
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.peft_adapter import read_adapter
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.lora import LoraAdapter, LowRank, StepLora, step_lora

logger = logging.getLogger(__name__)


class AdapterSet:
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None,
        load: TorchLoadConfig,
    ) -> None:
        """``kernels``: the CPU kernels' GEMM where it serves the projections."""
        self.config, self.dtype, self.device = config, dtype, device
        self.kernels = kernels
        self.max_rank = load.max_lora_rank
        self.invariant = load.batch_invariant
        self._held: HeldAdapters[LoraAdapter] = HeldAdapters(load.max_loras)

    @property
    def adapters(self) -> list[AdapterInfo]:
        return self._held.infos

    def load(self, name: str, path: Path) -> AdapterInfo:
        self._held.check_name(name)
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder (a PEFT adapter is one)")
        adapter = read_adapter(
            name, path, self.config, self.max_rank, self.dtype, self.device, self._low_rank
        )
        self._held.add(adapter.info, lambda: adapter)
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, id %x)",
            name, path, adapter.info.rank, adapter.info.adapter_id,
        )  # fmt: skip
        return adapter.info

    def _low_rank(self, down: torch.Tensor, up: torch.Tensor) -> LowRank:
        return LowRank(down, up, self.kernels, self.invariant)

    def unload(self, name: str) -> AdapterInfo:
        info, _ = self._held.remove(name)
        logger.info("LoRA adapter %s unloaded", name)
        return info

    def step(self, row_adapters: Sequence[tuple[int, int]]) -> StepLora | None:
        """(adapter id, rows) per chunk, in the step's row order: the step's groups, or None
        when no row has an adapter."""
        if not self._held.by_id:
            return None
        return step_lora(self._held.by_id, row_adapters, self.device)
