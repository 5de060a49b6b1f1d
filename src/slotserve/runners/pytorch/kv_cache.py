"""The paged KV pool of the PyTorch runner: one K and one V tensor per layer, blocks shared by
reference between slots for prefix-cache hits (bookkeeping in
``engine/prefix_cache/block_table.py``).

Sized from a memory budget: ``num_blocks = budget // (block_size × bytes per position)``. One
extra block at the end is never handed out and stays zero: attention pads gathers with it.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from slotserve.engine.prefix_cache.block_table import PagedKvTables
from slotserve.runners.pytorch.config import ModelConfig


class KvPool:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.tables = PagedKvTables(num_blocks, block_size, num_slots)
        self.zero_block = num_blocks
        rows = (num_blocks + 1) * block_size
        # Zeroed: gathers read padding from the zero block, and a freed block's old contents
        # are finite, so masked positions contribute exact zeros. A Gated DeltaNet layer keeps
        # no KV (an empty entry keeps the list indexed by layer).
        self.layers = []
        for layer in range(config.num_layers):
            shape = (0 if config.is_linear(layer) else rows, config.num_kv_heads, config.head_dim)
            self.layers.append(
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
            )
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def capacity_tokens(self) -> int:
        return self.tables.num_blocks * self.block_size

    def reserve(self, slot: int, num_tokens: int) -> bool:
        copies = self.tables.reserve(slot, num_tokens)
        if copies is None:
            return False
        self._pending_copies.extend(copies)
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The block copies ``reserve`` asked for since the last step (for :meth:`copy_blocks`
        on every tensor-parallel rank)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a block about to be written while shared gets its own copy first."""
        size = self.block_size
        for src, dst in copies:
            for key_cache, value_cache in self.layers:
                key_cache[dst * size : (dst + 1) * size] = key_cache[src * size : (src + 1) * size]
                value_cache[dst * size : (dst + 1) * size] = value_cache[
                    src * size : (src + 1) * size
                ]

    def rows(self, slot: int, start: int, end: int) -> list[int]:
        """Cache rows of the slot's positions ``start .. end - 1`` (reserved)."""
        table, size = self.tables.tables[slot], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def used_tokens(self, slots: Collection[int]) -> int:
        return self.tables.used_blocks(slots) * self.block_size
