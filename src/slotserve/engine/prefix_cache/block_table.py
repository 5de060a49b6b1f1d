"""Block tables of a paged KV cache: which pool blocks hold each slot's positions.

Pure bookkeeping, no tensors: a runner keeps its K/V in a pool of ``num_blocks`` blocks of
``block_size`` positions and asks this class where each slot's positions live. Blocks are
shared by reference between slots (a prefix-cache hit copies no KV) and freed when the last
reference goes::

    slot 0: [b3][b7][b2]      positions 0..11 (block_size 4), length 10
    slot 1: [b3][b7]          copy(0 → 1, 7 tokens): b3, b7 now have 2 references
            [b3][b9]          slot 1 writes position 7 (inside shared b7): copy-on-write,
                              the runner copies b7 → b9 first (``reserve`` returns the pair)

Rules:

* A slot's positions ``0 .. length - 1`` are valid; blocks past the length may be reserved
  for positions about to be written.
* Writing into a block with more than one reference first copies it (``reserve`` allocates
  the copy and returns ``(source, destination)`` pairs for the runner to apply before the
  forward that writes).
* ``reserve`` allocates all it needs or nothing (None: the pool is short).
* Besides slots, an owner outside (the prefix cache's radix tree) may **hold** blocks: a held
  block stays allocated after every slot dropped it, and ``share`` hands it to a slot again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


class PagedKvTables:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a paged KV cache needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.lengths = [0] * num_slots
        self._refs = [0] * num_blocks  # slot tables' references plus holds
        self._held = [0] * num_blocks  # holds by the owner outside (the prefix cache)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, slot: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Makes room for positions up to ``num_tokens - 1``; returns the block copies to do
        first (copy-on-write of a shared block about to be written), or None, with nothing
        changed, when the pool has too few free blocks."""
        table = self.tables[slot]
        length = self.lengths[slot]
        new_blocks = max(0, self.blocks_for(num_tokens) - len(table))
        write_block = length // self.block_size
        copy_on_write = (
            num_tokens > length and write_block < len(table) and self._refs[table[write_block]] > 1
        )
        if new_blocks + copy_on_write > len(self._free):
            return None
        copies = []
        if copy_on_write:
            shared = table[write_block]
            private = self._allocate()
            copies.append((shared, private))
            self._unref(shared)
            table[write_block] = private
        table.extend(self._allocate() for _ in range(new_blocks))
        return copies

    def commit(self, slot: int, num_tokens: int) -> None:
        """Records that positions up to ``num_tokens - 1`` were written (all reserved)."""
        assert self.blocks_for(num_tokens) <= len(self.tables[slot]), "write past the reserve"
        self.lengths[slot] = max(self.lengths[slot], num_tokens)

    def copy(self, src: int, dst: int, num_tokens: int) -> None:
        """``dst`` holds the first ``num_tokens`` positions of ``src`` by shared reference."""
        assert src != dst and num_tokens <= self.lengths[src]
        self.share(dst, self.tables[src], num_tokens)

    def share(self, slot: int, blocks: Sequence[int], num_tokens: int) -> None:
        """``slot``'s positions ``0 .. num_tokens - 1`` become those of ``blocks`` (shared by
        reference; its earlier blocks are dropped)."""
        shared = list(blocks[: self.blocks_for(num_tokens)])
        assert len(shared) == self.blocks_for(num_tokens), "too few blocks for the positions"
        for block in shared:
            assert self._refs[block] > 0, f"block {block} is free"
            self._refs[block] += 1
        self.trim(slot, 0)
        self.tables[slot] = shared
        self.lengths[slot] = num_tokens

    def table(self, slot: int) -> list[int]:
        """The blocks holding ``slot``'s positions, in order (do not modify)."""
        return self.tables[slot]

    def hold(self, blocks: Sequence[int]) -> None:
        """Keeps ``blocks`` allocated for the owner outside until :meth:`unhold`."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is free"
            self._refs[block] += 1
            self._held[block] += 1

    def drop_holds(self) -> None:
        """Gives back every hold (a new prefix cache starts from nothing)."""
        for block, holds in enumerate(self._held):
            for _ in range(holds):
                self._unref(block)
        self._held = [0] * self.num_blocks

    def unhold(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            assert self._held[block] > 0, f"block {block} is not held"
            self._held[block] -= 1
            self._unref(block)

    def trim(self, slot: int, num_tokens: int) -> None:
        """Keeps positions ``0 .. num_tokens - 1``; later blocks lose this slot's reference."""
        table = self.tables[slot]
        keep = self.blocks_for(num_tokens)
        for block in table[keep:]:
            self._unref(block)
        del table[keep:]
        self.lengths[slot] = min(self.lengths[slot], num_tokens)

    def used_blocks(self, slots: Collection[int]) -> int:
        """Distinct blocks the slots reference."""
        return len({block for slot in slots for block in self.tables[slot]})

    def check_integrity(self, held: Mapping[int, int] | None = None) -> None:
        """Raises ``AssertionError`` when reference counts disagree with the tables and the
        holds; ``held`` (block -> holds), when given, is what the outside owner believes."""
        counts = list(self._held)
        for slot, table in enumerate(self.tables):
            assert self.blocks_for(self.lengths[slot]) <= len(table), f"slot {slot} overruns"
            for block in table:
                counts[block] += 1
        assert counts == self._refs, "reference counts disagree with the block tables"
        if held is not None:
            actual = {block: n for block, n in enumerate(self._held) if n}
            assert actual == {b: n for b, n in held.items() if n}, "holds disagree with the owner"
        free = sorted(self._free)
        assert free == [b for b in range(self.num_blocks) if counts[b] == 0], "free list"

    def _allocate(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
