"""Where each slot's KV stream ends in the slot prefix cache's radix tree (``slot_cache.py``).

On llama.cpp's per-sequence KV the cache keeps a :class:`~.radix_tree.RadixTree` whose node
handles are the sets of sequence ids whose content *ends* at that node. A sequence id holds the
whole path from the root to its node, so every holder of a node is found in its subtree, and
a node nobody holds is pruned. :class:`SlotStreams` keeps that record (every slot ends at one
node, the root when it holds nothing; a running slot locks its path) and checks it against the
runner; :class:`~.slot_cache.SlotPrefixCache` decides what each stream holds.
"""

from __future__ import annotations

from collections.abc import Mapping

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.prefix_cache.base import PrefixMatch, TreePrefixCache
from slotserve.engine.prefix_cache.host_tier import HostTier
from slotserve.engine.prefix_cache.radix_tree import RadixTree
from slotserve.engine.prefix_cache.runner_kv import KvStore, SavableKvStore
from slotserve.engine.prefix_cache.state_snapshots import SnapshotBook
from slotserve.engine.prefix_cache.tree_node import TreeNode

Holders = set[int]  # sequence ids whose cached content ends at a node
CacheNode = TreeNode[Holders]


def _split_holders(holders: Holders, k: int) -> tuple[Holders, Holders]:
    # Sequences that ended at the split node hold all of it: they end at the lower half.
    return set(), holders


class SlotStreams(TreePrefixCache[Holders]):
    """Engine-thread only. Slots are the runner's sequence ids ``0 .. num_slots - 1``; the
    saved states behind them (``host``) and their recurrent-state snapshots (``snapshots``)
    are the cache's, given here."""

    def __init__(
        self,
        kv: KvStore,
        num_slots: int,
        policy: ChunkPolicy,
        budget_tokens: int,
        kv_bytes_per_token: int,
        host: HostTier | None = None,
        snapshots: SnapshotBook | None = None,
    ) -> None:
        super().__init__(RadixTree(set, _split_holders), policy, budget_tokens, kv_bytes_per_token)
        self.kv = kv
        # Only a runner that can save and restore a sequence's state gets the host tier.
        self.host = host if isinstance(kv, SavableKvStore) else None
        # A saved state has no recurrent state beside it: the tier is for attention-only KV.
        assert self.host is None or snapshots is None, "a host tier for a recurrent model"
        self.snapshots = snapshots
        self._end: dict[int, CacheNode] = {s: self.tree.root for s in range(num_slots)}
        self.tree.root.value.update(self._end)
        self._running: set[int] = set()
        self._unsettled: set[int] = set()  # free slots an eviction moved up (recurrent state)

    def holders(self, match: PrefixMatch) -> set[int]:
        """Slots whose KV starts with the matched prefix."""
        return self._holders_of(match.node) if match.length else set()

    def _holders_of(self, node: CacheNode) -> set[int]:
        return {slot for walk in self.tree.subtree(node) for slot in walk.value}

    def is_running(self, slot: int) -> bool:
        """True between ``attach`` and ``release`` / ``drop``."""
        return slot in self._running

    def _set_end(self, slot: int, node: CacheNode) -> None:
        old = self._end[slot]
        if old is node:
            return
        old.value.discard(slot)
        node.value.add(slot)
        self._end[slot] = node
        if slot in self._running:
            self.tree.lock(node)
            self.tree.unlock(old)
        # Nodes no slot holds any more lost their KV: that is an eviction too.
        nodes_before = self.tree.num_nodes
        book = self.snapshots
        self.evicted_tokens += self.tree.prune(old, None if book is None else book.release_node)
        self.evictions += nodes_before - self.tree.num_nodes

    def _forget(self, slot: int) -> None:
        """Stops tracking a free slot's content (the caller overwrites or frees its KV)."""
        self._set_end(slot, self.tree.root)

    def _exclusive_tokens(self, slot: int) -> int:
        """Cached tokens only this slot holds: what reusing the slot for other work loses."""
        exclusive = 0
        node = self._end[slot]
        while node.parent is not None:
            others = {s for n in self.tree.subtree(node) for s in n.value}
            if others != {slot}:
                break
            exclusive += len(node.key)
            node = node.parent
        return exclusive

    def held_tokens(self, slot: int) -> list[int]:
        """The token prefix the cache records for ``slot``'s KV."""
        return self.tree.path_tokens(self._end[slot])

    def check_integrity(self, running_tokens: Mapping[int, int]) -> None:
        """Raises ``AssertionError`` when the tree, the locks or the runner's KV disagree.

        ``running_tokens`` maps each running slot to the tokens its KV must hold. Every other
        slot must hold exactly the prefix the tree records for it, so free + cached + in-use
        KV account for every slot's stream.
        """
        self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        if self.snapshots is not None:
            nodes = list(self.tree.subtree(self.tree.root))
            self.snapshots.check_integrity(nodes, running_tokens)
        assert set(running_tokens) == self._running, (
            f"running slots {sorted(running_tokens)}, cache thinks {sorted(self._running)}"
        )
        seen: dict[int, CacheNode] = {}
        for node in self.tree.subtree(self.tree.root):
            for slot in node.value:
                assert slot not in seen, f"slot {slot} ends at two nodes"
                seen[slot] = node
        assert seen == self._end, "holder sets and slot ends disagree"
        assert self.tree.root.lock_ref == len(self._running), (
            f"root lock_ref {self.tree.root.lock_ref} != {len(self._running)} running slots"
        )
        for slot, node in self._end.items():
            held = self.kv.kv_tokens(slot)
            if slot in self._running:
                expected = running_tokens[slot]
                assert node.end <= expected, f"slot {slot} claims {node.end} > {expected} tokens"
            else:
                expected = node.end
            assert held == expected, f"slot {slot} KV holds {held} tokens, expected {expected}"
