"""The LoRA adapters the PyTorch runner holds (``--lora-modules``, loaded and unloaded at run
time), at most ``--max-loras`` at once, and each step's rows matched to them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from slotserve.engine.runner_interface import AdapterInfo
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.checkpoint import TorchLoadConfig
from slotserve.runners.pytorch.load.peft_adapter import read_adapter
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
        self.max_loras, self.max_rank = load.max_loras, load.max_lora_rank
        self.invariant = load.batch_invariant
        self._by_id: dict[int, LoraAdapter] = {}
        self._by_name: dict[str, AdapterInfo] = {}

    @property
    def adapters(self) -> list[AdapterInfo]:
        return list(self._by_name.values())

    def load(self, name: str, path: Path) -> AdapterInfo:
        if name in self._by_name:
            raise ValueError(f"an adapter named {name} is loaded already; unload it first")
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder (a PEFT adapter is one)")
        adapter = read_adapter(
            name, path, self.config, self.max_rank, self.dtype, self.device, self._low_rank
        )
        known = self._by_id.get(adapter.info.adapter_id)
        if known is None and len(self._by_id) >= self.max_loras:
            raise ValueError(
                f"{len(self._by_id)} adapters are loaded, the --max-loras limit: unload one "
                f"before loading {name}"
            )
        if known is None:
            self._by_id[adapter.info.adapter_id] = adapter
        self._by_name[name] = adapter.info
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, id %x)",
            name, path, adapter.info.rank, adapter.info.adapter_id,
        )  # fmt: skip
        return adapter.info

    def _low_rank(self, down: torch.Tensor, up: torch.Tensor) -> LowRank:
        return LowRank(down, up, self.kernels, self.invariant)

    def unload(self, name: str) -> AdapterInfo:
        info = self._by_name.pop(name)  # KeyError: none has the name
        if all(other.adapter_id != info.adapter_id for other in self._by_name.values()):
            del self._by_id[info.adapter_id]
        logger.info("LoRA adapter %s unloaded", name)
        return info

    def step(self, row_adapters: Sequence[tuple[int, int]]) -> StepLora | None:
        """(adapter id, rows) per chunk, in the step's row order: the step's groups, or None
        when no row has an adapter."""
        if not self._by_id:
            return None
        return step_lora(self._by_id, row_adapters, self.device)
