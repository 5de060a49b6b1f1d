"""A radix (PATRICIA) tree over token ids whose nodes carry KV handles.

Each edge holds a run of token ids; the path from the root to a node spells a token prefix.
A node's ``value`` is an opaque handle the owner defines for the KV of that node's tokens
(the llama.cpp prefix cache stores the KV sequence ids whose content ends at the node; a paged
runner would store block ids). The tree never reads a handle: it only splits one when an
edge is split (``split_value``) and tests it for truth when pruning.

The whole API: :meth:`match_prefix`, :meth:`insert`, :meth:`lock` / :meth:`unlock`,
:meth:`evict`, :meth:`prune` and :meth:`check_integrity`; its nodes and matches:
``tree_node.py``.

Rules:

* **Lock before use.** A node whose KV a running sequence relies on is locked; ``lock`` counts
  the reference on the node and every ancestor up to the root, ``unlock`` takes it back.
* **Evicting never touches a locked node**, nor the root. Only leaves go, least recently
  matched or inserted first; a parent whose last child went becomes a leaf and may go next.
  Candidates wait in one heap kept across calls: a node is pushed whenever it may have become
  evictable (new leaf, touched, unlocked, lost its last child), and stale entries are skipped
  when popped, so eviction under memory pressure costs O(log n) a node, not a scan of the tree.
* **A leaf always has a handle.** A leaf whose handle became empty holds no KV and is pruned.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Generic

from slotserve.engine.prefix_cache.tree_node import Match, TreeNode, V, common_prefix_length


class RadixTree(Generic[V]):
    def __init__(self, new_value: Callable[[], V], split_value: Callable[[V, int], tuple[V, V]]):
        """``new_value`` makes the handle of a new node; ``split_value(value, k)`` divides a
        node's handle between its first ``k`` tokens and the rest when the edge is split."""
        self._new_value = new_value
        self._split_value = split_value
        self._clock = itertools.count(1)
        self.root: TreeNode[V] = TreeNode(key=[], value=new_value(), parent=None, end=0)
        # (last_access when pushed, tie-breaker, node): eviction candidates, possibly stale.
        self._heap: list[tuple[int, int, TreeNode[V]]] = []
        self._pushes = itertools.count()
        self.total_tokens = 0
        self.evictable_tokens = 0  # tokens in unlocked nodes
        self.num_nodes = 0  # excluding the root

    # ---- lookup and insertion -------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> Match[V]:
        """Finds the longest prefix of ``tokens`` in the tree; marks the path recently used."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            self._touch(child, now)
            matched = common_prefix_length(child.key, tokens[pos : pos + len(child.key)])
            pos += matched
            node = child
            if matched < len(child.key):
                break
        return Match(node, pos)

    def insert(self, tokens: Sequence[int]) -> TreeNode[V]:
        """Makes ``tokens`` a path of the tree; returns the node that ends exactly there.

        Existing nodes are kept (an edge matched partly is split); the missing tail becomes one
        new leaf with a fresh handle. The caller then records its KV in the node's handle.
        """
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf: TreeNode[V] = TreeNode(
                    key=list(tokens[pos:]),
                    value=self._new_value(),
                    parent=node,
                    end=len(tokens),
                    last_access=now,
                )
                node.children[leaf.key[0]] = leaf
                self.num_nodes += 1
                self.total_tokens += len(leaf.key)
                self.evictable_tokens += len(leaf.key)
                self._push(leaf)
                return leaf
            self._touch(child, now)
            matched = common_prefix_length(child.key, tokens[pos : pos + len(child.key)])
            if matched < len(child.key):
                child = self._split(child, matched)
            node, pos = child, pos + matched
        return node

    def _split(self, node: TreeNode[V], k: int) -> TreeNode[V]:
        """Cuts ``node``'s edge after ``k`` tokens; returns the new upper node."""
        assert 0 < k < len(node.key) and node.parent is not None
        head_value, tail_value = self._split_value(node.value, k)
        upper: TreeNode[V] = TreeNode(
            key=node.key[:k],
            value=head_value,
            parent=node.parent,
            end=node.start + k,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.value = tail_value
        node.parent = upper
        upper.children[node.key[0]] = node
        self.num_nodes += 1
        return upper

    # ---- locking ----------------------------------------------------------------------------

    def lock(self, node: TreeNode[V]) -> None:
        """Protects ``node`` and its ancestors from eviction until :meth:`unlock`."""
        walk: TreeNode[V] | None = node
        while walk is not None:
            if walk.lock_ref == 0 and walk.parent is not None:
                self.evictable_tokens -= len(walk.key)
            walk.lock_ref += 1
            walk = walk.parent

    def unlock(self, node: TreeNode[V]) -> None:
        walk: TreeNode[V] | None = node
        while walk is not None:
            if walk.lock_ref <= 0:
                raise RuntimeError("unlock without a matching lock")
            walk.lock_ref -= 1
            if walk.lock_ref == 0 and walk.parent is not None:
                self.evictable_tokens += len(walk.key)
                self._push(walk)
            walk = walk.parent

    # ---- removal ----------------------------------------------------------------------------

    def evict(self, num_tokens: int, on_evict: Callable[[TreeNode[V]], None]) -> int:
        """Removes unlocked leaves, least recently used first, until ``num_tokens`` are gone.

        ``on_evict(node)`` runs before each node leaves the tree, so the owner can free (or
        hand to the parent) the KV its handle names. Returns the number of tokens removed.
        """
        freed = 0
        while self._heap and freed < num_tokens:
            access, _, node = heapq.heappop(self._heap)
            if access != node.last_access or not self._evictable(node):
                continue  # stale: touched since, gained a child or a lock, or already gone
            on_evict(node)
            self._remove_leaf(node)
            freed += len(node.key)
        return freed

    def _touch(self, node: TreeNode[V], now: int) -> None:
        node.last_access = now
        self._push(node)

    def _push(self, node: TreeNode[V]) -> None:
        if not node.is_leaf:
            return
        heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))
        # Touches and unlocks leave stale entries behind, whether or not the owner ever
        # evicts: past a bound, start afresh from the leaves.
        if len(self._heap) > 4 * self.num_nodes + 64:
            leaves = (n for n in self._nodes() if n.is_leaf)
            self._heap = [(n.last_access, next(self._pushes), n) for n in leaves]
            heapq.heapify(self._heap)

    def prune(
        self, node: TreeNode[V], on_remove: Callable[[TreeNode[V]], None] | None = None
    ) -> int:
        """Removes ``node`` and then its ancestors while each is an unlocked leaf with an empty
        handle (no KV left behind it), telling ``on_remove`` of each; returns the number of
        tokens removed."""
        removed = 0
        walk = node
        while walk.parent is not None and walk.is_leaf and walk.lock_ref == 0 and not walk.value:
            removed += len(walk.key)
            if on_remove is not None:
                on_remove(walk)
            walk = self._remove_leaf(walk)
        return removed

    def _evictable(self, node: TreeNode[V]) -> bool:
        return node.parent is not None and node.is_leaf and node.lock_ref == 0

    def _remove_leaf(self, node: TreeNode[V]) -> TreeNode[V]:
        parent = node.parent
        assert parent is not None and node.is_leaf
        del parent.children[node.key[0]]
        node.parent = None
        self.num_nodes -= 1
        self.total_tokens -= len(node.key)
        if node.lock_ref == 0:
            self.evictable_tokens -= len(node.key)
        if parent.parent is not None:
            self._push(parent)  # may have become a leaf
        return parent

    # ---- inspection -------------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode[V]]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def subtree(self, node: TreeNode[V]) -> Iterator[TreeNode[V]]:
        """``node`` and all its descendants."""
        stack = [node]
        while stack:
            walk = stack.pop()
            yield walk
            stack.extend(walk.children.values())

    def path_tokens(self, node: TreeNode[V]) -> list[int]:
        """The token prefix the path from the root to ``node`` spells."""
        parts: list[list[int]] = []
        walk: TreeNode[V] | None = node
        while walk is not None:
            parts.append(walk.key)
            walk = walk.parent
        return [token for part in reversed(parts) for token in part]

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` naming the first broken structural rule."""
        total = evictable = count = 0
        root = self.root
        assert root.parent is None and not root.key and root.end == 0, "malformed root"
        for node in self.subtree(root):
            children_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"child at depth {child.end} has a stale parent"
                assert child.key, f"empty edge under the node ending at {node.end}"
                assert child.key[0] == first, f"child keyed by {first} starts {child.key[0]}"
                assert child.end == node.end + len(child.key), f"bad depth at {child.end}"
                children_locks += child.lock_ref
            assert node.lock_ref >= children_locks, (
                f"node ending at {node.end} has lock_ref {node.lock_ref} < its children's "
                f"{children_locks}"
            )
            if node is root:
                continue
            count += 1
            total += len(node.key)
            if node.lock_ref == 0:
                evictable += len(node.key)
            assert node.children or node.value, f"leaf ending at {node.end} has no KV handle"
        assert count == self.num_nodes, f"{count} nodes, counter says {self.num_nodes}"
        assert total == self.total_tokens, f"{total} tokens, counter says {self.total_tokens}"
        assert evictable == self.evictable_tokens, (
            f"{evictable} evictable tokens, counter says {self.evictable_tokens}"
        )
