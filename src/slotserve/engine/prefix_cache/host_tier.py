"""The prefix cache's host-RAM tier: sequence states saved out of KV slots before their content
is lost, so that a later prompt with the same prefix restores them instead of computing.

A saved state covers positions ``0 .. n-1`` of one token path (a slot's whole content, as the
runner's per-sequence state API writes it). The tier keeps them in a radix tree of those paths:
a state ends at a leaf, and a prompt matching ``m`` tokens of a path can restore its state and
trim it to ``m``. Saving a path that extends a saved one replaces it (the longer state covers
the shorter); saving a path another state already covers keeps nothing new.

The budget is in bytes; the least recently saved or restored states go first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slotserve.engine.prefix_cache.radix_tree import RadixTree, TreeNode


@dataclass(eq=False)
class SavedState:
    """One sequence state in host memory: the runner's bytes for ``num_tokens`` positions."""

    num_tokens: int
    data: bytearray


HostNode = TreeNode[SavedState | None]


@dataclass(frozen=True)
class HostMatch:
    """The longest prefix of a prompt some saved state covers: ``length`` tokens, restorable
    from the state at ``leaf`` (the smallest one covering them)."""

    leaf: HostNode
    length: int


def _state_ends_below(value: SavedState | None, k: int) -> tuple[None, SavedState | None]:
    return None, value


@dataclass
class HostTierCounters:
    """Totals since start, for the prefix cache's statistics."""

    hits: int = 0  # sequences whose cached prefix was restored from host memory
    hit_tokens: int = 0
    saves: int = 0
    saved_tokens: int = 0
    evictions: int = 0
    restore_seconds: float = 0.0
    save_seconds: float = 0.0


class HostTier:
    """Engine-thread only."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.tree: RadixTree[SavedState | None] = RadixTree(lambda: None, _state_ends_below)
        self.bytes = 0
        self.entries = 0
        self.counters = HostTierCounters()

    def match(self, tokens: Sequence[int]) -> HostMatch | None:
        """The longest prefix of ``tokens`` a saved state covers; None when none does."""
        found = self.tree.match_prefix(tokens)
        if found.length == 0:
            return None
        leaves = [n for n in self.tree.subtree(found.node) if n.value is not None]
        return HostMatch(min(leaves, key=lambda n: n.end), found.length)

    def covers(self, path: Sequence[int]) -> bool:
        """True when a saved state already holds every token of ``path``."""
        return self.tree.match_prefix(path).length == len(path)

    def save(self, path: Sequence[int], write: Callable[[], bytearray]) -> bool:
        """Keeps the state ``write()`` returns for ``path`` unless one already covers it or it
        cannot fit the budget; returns whether it was kept."""
        if not path or self.covers(path):
            return False
        started = time.perf_counter()
        data = write()
        self.counters.save_seconds += time.perf_counter() - started
        if len(data) > self.budget_bytes:
            return False
        node = self.tree.insert(path)
        assert node.value is None and node.is_leaf, "a covered path was saved twice"
        # States of the path's own prefixes are covered by this one now.
        walk = node.parent
        while walk is not None and walk.parent is not None:
            if walk.value is not None:
                self._forget(walk)
            walk = walk.parent
        node.value = SavedState(len(path), data)
        self.bytes += len(data)
        self.entries += 1
        self.counters.saves += 1
        self.counters.saved_tokens += len(path)
        self._evict_over(self.budget_bytes)
        return True

    def record_restore(self, match: HostMatch, tokens: int, seconds: float) -> None:
        """Counts a hit of ``tokens`` restored from ``match`` in ``seconds``; the state becomes
        the most recently used (unless saving the slot's old content just replaced it)."""
        self.counters.hits += 1
        self.counters.hit_tokens += tokens
        self.counters.restore_seconds += seconds
        if match.leaf.parent is not None:
            self.tree.match_prefix(self.tree.path_tokens(match.leaf))

    def clear(self) -> int:
        """Drops every saved state; returns the tokens they covered."""
        return self._evict_over(0)

    def _evict_over(self, budget: int) -> int:
        """Drops the least recently used states until they take at most ``budget`` bytes;
        returns the tokens they covered."""
        freed = 0
        parents: list[HostNode] = []

        def drop(node: HostNode) -> None:
            nonlocal freed
            freed += self._drop_state(node)
            self.counters.evictions += 1
            assert node.parent is not None
            parents.append(node.parent)

        while self.bytes > budget and self.tree.evict(1, drop):
            while parents:  # an inner node left without children holds nothing
                self.tree.prune(parents.pop())
        return freed

    def _forget(self, node: HostNode) -> None:
        """Drops an inner node's state (a longer one now covers it)."""
        self._drop_state(node)
        self.tree.prune(node)

    def _drop_state(self, node: HostNode) -> int:
        state = node.value
        assert state is not None
        node.value = None
        self.bytes -= len(state.data)
        self.entries -= 1
        return state.num_tokens

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` when the tree and the byte and entry counts disagree."""
        self.tree.check_integrity()
        states = [n.value for n in self.tree.subtree(self.tree.root) if n.value is not None]
        assert len(states) == self.entries, f"{len(states)} saved states, count {self.entries}"
        total = sum(len(s.data) for s in states)
        assert total == self.bytes, f"saved states take {total} bytes, count {self.bytes}"
        assert self.bytes <= self.budget_bytes, f"{self.bytes} bytes over {self.budget_bytes}"
        for node in self.tree.subtree(self.tree.root):
            if node.value is not None:
                assert node.is_leaf, f"a saved state ends at an inner node ({node.end} tokens)"
                assert node.value.num_tokens == node.end, "a state's length is not its path's"
