"""What the prefix caches need of the runner's KV, beside the ``Runner`` contract's own words
for it: the per-slot operations both caches use (:class:`SlotKv`), the copy between streams
the slot cache adds (:class:`KvStore`), and the saves to host memory and back that the host and
disk tiers need, per slot (:class:`SavableKvStore`) or per block (:class:`SavablePagedKv`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class SlotKv(Protocol):
    """The per-slot KV operations every cache needs from the runner (see ``Runner``)."""

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        """Keeps only the first ``num_tokens`` positions of ``slot``'s KV."""
        ...

    def kv_tokens(self, slot: int) -> int:
        """How many positions (``0 .. n-1``) ``slot``'s KV holds."""
        ...


class KvStore(SlotKv, Protocol):
    """KV per sequence id, one stream a slot (the slot cache's runner)."""

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """Replaces ``dst_slot``'s KV with the first ``num_tokens`` positions of ``src_slot``'s."""
        ...


class Fingerprinted(Protocol):
    """A runner whose saved states say what they are valid for (both tiers' runners)."""

    def kv_fingerprint(self) -> str:
        """What a saved state is only valid for: the model's weights, the runner, its KV
        layout and dtype (the disk tier keeps states of one fingerprint apart)."""
        ...


@runtime_checkable
class SavableKvStore(KvStore, Fingerprinted, Protocol):
    """A runner that can also copy one sequence's state out to host memory and back."""

    def save_kv(self, slot: int) -> bytearray:
        """The runner's serialised state of ``slot``'s KV (all its positions)."""
        ...

    def restore_kv(self, slot: int, data: bytearray) -> bool:
        """Replaces ``slot``'s KV with a state :meth:`save_kv` wrote. False when it cannot:
        the slot's KV is then empty, or unchanged when the runner refused before touching it
        (its content is still to be copied to another slot in this step)."""
        ...


@runtime_checkable
class SavablePagedKv(SlotKv, Fingerprinted, Protocol):
    """A paged runner that can also copy the KV of positions out to host memory and back."""

    def reserve_kv(self, slot: int, num_tokens: int) -> bool: ...

    def save_kv_blocks(self, blocks: Sequence[int], num_tokens: int) -> bytearray:
        """The runner's serialised KV of positions ``0 .. num_tokens - 1``, held in
        ``blocks`` (every layer)."""
        ...

    def restore_kv_blocks(self, slot: int, start: int, end: int, data: bytearray) -> bool:
        """Writes positions ``start .. end - 1`` of a state :meth:`save_kv_blocks` wrote into
        ``slot``'s reserved blocks and records them written. False, with nothing written, when
        ``data`` is not such a state or holds fewer positions."""
        ...
