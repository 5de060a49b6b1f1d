"""A runner's KV as the engine manages it, beside the ``Runner`` contract's own words for it:
a pool of fixed-size blocks shared by reference (:class:`PagedKv`), copies of a recurrent
state kept at chosen positions (:class:`StateSnapshots`), and the reservation the scheduler
makes before a chunk runs (:class:`KvAllocator`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable


class PagedKv(Protocol):
    """Block tables of a runner whose KV is a pool of fixed-size blocks shared by reference
    (``engine/prefix_cache/block_table.py``). The prefix cache holds blocks of cached prefixes
    itself and hands them to slots; the runner copies a shared block before writing into it."""

    block_size: int

    def table(self, slot: int) -> Sequence[int]:
        """The blocks holding ``slot``'s positions, in order."""
        ...

    def share(self, slot: int, blocks: Sequence[int], num_tokens: int) -> None:
        """``slot``'s positions ``0 .. num_tokens - 1`` become those of ``blocks``."""
        ...

    def hold(self, blocks: Sequence[int]) -> None:
        """Keeps ``blocks`` allocated (for the cache) until :meth:`unhold`."""
        ...

    def unhold(self, blocks: Sequence[int]) -> None: ...

    def drop_holds(self) -> None:
        """Gives back every hold (a new engine's cache starts from nothing)."""
        ...

    def check_integrity(self, held: Mapping[int, int] | None = None) -> None:
        """Raises ``AssertionError`` when counts disagree with the tables and ``held``."""
        ...


@runtime_checkable
class StateSnapshots(Protocol):
    """A runner whose model carries a recurrent state beside its KV (Gated DeltaNet layers),
    which a prefix of positions cannot be cut from: the prefix cache keeps copies of it,
    taken at chosen positions of a prompt (multiples of the chunk policy's grain, where the
    state is the same for every prompt through that prefix), in ``snapshot_capacity``
    numbered places the cache allocates."""

    @property
    def snapshot_capacity(self) -> int: ...

    @property
    def snapshot_bytes(self) -> int:
        """The memory one snapshot takes."""
        ...

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        """When ``slot``'s coming prompt chunks reach ``position`` tokens, its state then is
        copied into ``snapshot`` (overwriting it). Forgotten by ``trim_kv(slot, 0)`` (with
        per-slot streams, by any ``trim_kv`` of the slot)."""
        ...

    def restore_state(self, slot: int, snapshot: int) -> None:
        """``slot``'s next chunk starts from the state in ``snapshot`` (read when that chunk
        runs, before any save of the same step; with per-slot streams, read at once, so the
        stream can then be trimmed to the snapshot's position)."""
        ...


class KvAllocator(Protocol):
    """The runner's KV memory as the scheduler sees it (see ``Runner``)."""

    def reserve_kv(self, slot: int, num_tokens: int) -> bool: ...

    def trim_kv(self, slot: int, num_tokens: int) -> None: ...
