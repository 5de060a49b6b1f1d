"""LoRA adapters applied per row within one batched step (S-LoRA's and Punica's shape: the
base projection once for the whole batch, then each adapter's low-rank update for its own
rows); ``load/peft_adapter.py`` reads them.

An adapter's updates to the projections that the decoder fuses (q/k/v into ``qkv``, gate/up
into ``gate_up``) are fused the same way: the down-projections stacked, the up-projections
block-diagonal, so each fused projection takes two small matmuls per adapter. On CPU in
bfloat16 they run on the kernels' GEMM, whose rows never depend on the others: a request's
tokens stay the same alone and beside requests with other adapters or none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slotserve.engine.runner_interface import AdapterInfo
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.gpu_matmul import invariant_linear


class LowRank:
    """One fused projection's update for one adapter: ``x @ down.T @ up.T`` (the scale is in
    ``up``)."""

    def __init__(
        self,
        down: torch.Tensor,
        up: torch.Tensor,
        kernels: CpuKernels | None,
        invariant: bool = False,
    ) -> None:
        """``invariant``: through ``gpu_matmul.invariant_linear`` (--batch-invariant)."""
        self.rank, self.out_features = down.shape[0], up.shape[0]
        self.kernels = kernels
        self.linear = invariant_linear if invariant else F.linear
        if kernels is not None:
            self.down, self.up = kernels.pack_weight(down), kernels.pack_weight(up)
        else:
            self.down, self.up = down, up

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            inner = self.kernels.linear(x, self.down, None, self.rank)
            return self.kernels.linear(inner, self.up, None, self.out_features)
        return self.linear(self.linear(x, self.down), self.up)


@dataclass
class LoraAdapter:
    info: AdapterInfo
    layers: list[dict[str, LowRank]]  # by layer: by fused projection


class StepLora:
    """A step's adapters: which rows (of the step's flattened tokens) use which, as one range
    (read and written in place) or as an index (gathered and added back)."""

    def __init__(self, groups: Sequence[tuple[LoraAdapter, slice | torch.Tensor]]) -> None:
        self.groups = groups

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """``out`` (the projection ``target`` of ``x``, one row per token) with every row's
        adapter update added."""
        rows_in = x.reshape(-1, x.shape[-1])
        flat = out.view(-1, out.shape[-1])
        for adapter, rows in self.groups:
            update = adapter.layers[layer].get(target)
            if update is None:
                continue
            if isinstance(rows, slice):
                flat[rows].add_(update.delta(rows_in[rows]))
            else:
                flat.index_add_(0, rows, update.delta(rows_in.index_select(0, rows)))
        return out


@dataclass(frozen=True)
class LayerLora:
    """A step's adapters at one layer."""

    step: StepLora
    layer: int

    def add(self, out: torch.Tensor, x: torch.Tensor, target: str) -> torch.Tensor:
        return self.step.add(out, x, self.layer, target)


def step_lora(
    adapters: Mapping[int, LoraAdapter],
    row_adapters: Sequence[tuple[int, int]],
    device: torch.device,
) -> StepLora | None:
    """The step's groups from ``row_adapters``: (adapter id, rows) per chunk in row order."""
    rows: dict[int, list[int]] = {}
    first = 0
    for adapter_id, count in row_adapters:
        if adapter_id:
            rows.setdefault(adapter_id, []).extend(range(first, first + count))
        first += count
    if not rows:
        return None
    groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
    for adapter_id, indices in rows.items():
        start, end = indices[0], indices[-1] + 1
        if end - start == len(indices):  # one range
            groups.append((adapters[adapter_id], slice(start, end)))
        else:
            index = torch.tensor(indices, dtype=torch.int64, device=device)
            groups.append((adapters[adapter_id], index))
    return StepLora(groups)
