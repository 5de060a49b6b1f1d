"""What each slot holds on a rank, allocated at load: its KV in the paged pool
(:class:`KvPool`), and a Gated DeltaNet layer's recurrent state (:class:`LinearStatePool`).

The paged KV pool: one K and one V tensor per layer, blocks shared by reference between slots
for prefix-cache hits (bookkeeping in ``engine/prefix_cache/block_table.py``).

Sized from a memory budget: ``num_blocks = budget // (block_size × bytes per position)``. Two
extra blocks at the end are never handed out: the first stays zero (attention pads gathers
with it), the second takes the K/V of a CUDA graph's ballast rows (``cuda_graphs.py``).

With ``--kv-cache-dtype int8`` a position's row of a KV head is uint8: its int8 codes, then
their scale (``model/kv_int8.py``). The prefix cache's host and disk tiers keep positions copied
out of the pool (:meth:`KvPool.save_positions`) as one array ``[attention layer, K or V,
position, KV head, row]`` in the pool's dtype, whatever blocks held them: a state restores into
any blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch

from slotserve.engine.prefix_cache.block_table import PagedKvTables
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.kv_int8 import SCALE_BYTES


class KvPool:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        int8: bool = False,
        huge_pages: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """``huge_pages``: uninitialised CPU memory of so many bytes on huge pages
        (:meth:`CpuKernels.huge_page_buffer`), where a long context's lone row streams its
        blocks at the box's read rate; None: torch's allocator."""
        self.block_size = block_size
        row = config.head_dim + SCALE_BYTES if int8 else config.head_dim
        dtype = torch.uint8 if int8 else dtype
        self.tables = PagedKvTables(num_blocks, block_size, num_slots)
        self.zero_block = num_blocks
        self.ballast_row = (num_blocks + 1) * block_size
        rows = (num_blocks + 2) * block_size
        # Zeroed: gathers read padding from the zero block, and a freed block's old contents
        # are finite, so masked positions contribute exact zeros. A Gated DeltaNet layer keeps
        # no KV (an empty entry keeps the list indexed by layer).
        self.layers = []
        for layer in range(config.num_layers):
            shape = (0 if config.is_linear(layer) else rows, config.num_kv_heads, row)
            self.layers.append(
                (
                    _zeros(shape, dtype, device, huge_pages),
                    _zeros(shape, dtype, device, huge_pages),
                )
            )
        self._pending_copies: list[tuple[int, int]] = []
        self._attention = [kv for kv in self.layers if kv[0].shape[0]]
        self._position_shape = (config.num_kv_heads, row)
        self._dtype = dtype

    def clear(self) -> None:
        """Drops every layer's tensors: the memory goes back once no step holds them."""
        self.layers.clear()
        self._attention.clear()

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
        return self._rows_in(self.tables.tables[slot], start, end)

    def _rows_in(self, table: Sequence[int], start: int, end: int) -> list[int]:
        """Cache rows of positions ``start .. end - 1`` held in the blocks of ``table``."""
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def used_tokens(self, slots: Collection[int]) -> int:
        return self.tables.used_blocks(slots) * self.block_size

    # ---- positions copied out to host memory and back (the prefix cache's tiers) -----------

    @property
    def bytes_per_position(self) -> int:
        heads, dim = self._position_shape
        return 2 * len(self._attention) * heads * dim * self._dtype.itemsize

    def save_positions(self, blocks: Sequence[int], num_tokens: int) -> bytearray:
        """Positions ``0 .. num_tokens - 1``, held in ``blocks``, as one host array."""
        device = self._attention[0][0].device
        rows = torch.tensor(self._rows_in(blocks, 0, num_tokens), dtype=torch.long, device=device)
        data = bytearray(num_tokens * self.bytes_per_position)
        out = self._view(data, num_tokens)
        for layer, (key_cache, value_cache) in enumerate(self._attention):
            out[layer, 0].copy_(key_cache.index_select(0, rows))
            out[layer, 1].copy_(value_cache.index_select(0, rows))
        return data

    def load_positions(self, slot: int, start: int, end: int, data: bytearray) -> bool:
        """Writes positions ``start .. end - 1`` of a saved array into ``slot``'s reserved
        blocks; False, with nothing written, when ``data`` holds fewer positions or is not
        such an array."""
        held, rest = divmod(len(data), self.bytes_per_position)
        if rest or held < end or start >= end:
            return False
        device = self._attention[0][0].device
        rows = torch.tensor(self.rows(slot, start, end), dtype=torch.long, device=device)
        saved = self._view(data, held)
        for layer, (key_cache, value_cache) in enumerate(self._attention):
            key_cache.index_copy_(0, rows, saved[layer, 0, start:end].to(device))
            value_cache.index_copy_(0, rows, saved[layer, 1, start:end].to(device))
        self.tables.commit(slot, end)
        return True

    def _view(self, data: bytearray, num_tokens: int) -> torch.Tensor:
        flat = torch.frombuffer(data, dtype=torch.uint8).view(self._dtype)
        return flat.view(len(self._attention), 2, num_tokens, *self._position_shape)


def _zeros(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    huge_pages: Callable[[int], torch.Tensor] | None,
) -> torch.Tensor:
    if huge_pages is None or not math.prod(shape):
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_pages(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()


class LinearStatePool:
    """Every slot's DeltaNet state, per linear layer: ``conv[row]`` the convolution's last
    ``kernel - 1`` inputs (model dtype), ``recurrent[row]`` the ``[heads, d_k, d_v]`` float32
    matrices. Rows ``0 .. num_slots - 1`` are the slots'; the ``num_snapshots`` after them keep
    states saved for the prefix cache (:meth:`snapshot_row`)."""

    def __init__(
        self,
        c: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> None:
        rows = num_slots + num_snapshots
        self.num_slots = num_slots
        conv_shape = (rows, c.linear_conv_kernel - 1, c.linear_conv_channels)
        heads, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.layers = {
            index: (
                torch.zeros(conv_shape, dtype=dtype, device=device),
                torch.zeros((rows, heads, dk, dv), dtype=torch.float32, device=device),
            )
            for index in range(c.num_layers)
            if c.is_linear(index)
        }

    def snapshot_row(self, snapshot: int) -> int:
        return self.num_slots + snapshot

    def reset(self, slots: list[int]) -> None:
        if not slots:  # most steps: nothing starts at position 0
            return
        for conv, recurrent in self.layers.values():
            conv[slots] = 0
            recurrent[slots] = 0

    def copy(self, src_row: int, dst_row: int) -> None:
        for conv, recurrent in self.layers.values():
            conv[dst_row] = conv[src_row]
            recurrent[dst_row] = recurrent[src_row]

    def clear(self) -> None:
        self.layers.clear()
