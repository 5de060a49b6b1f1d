"""The prefix cache's host tiers: sequence states saved out of KV slots before their content
is lost, so that a later prompt with the same prefix restores them instead of computing.

A saved state covers positions ``0 .. n-1`` of one token path (a slot's whole content, as the
runner's per-sequence state API writes it). The tier keeps them in a radix tree of those paths:
a state ends at a leaf, and a prompt matching ``m`` tokens of a path can restore its state and
trim it to ``m``. Saving a path that extends a saved one replaces it (the longer state covers
the shorter); saving a path another state already covers keeps nothing new.

The tier serves both ways a runner keeps KV: states saved out of llama.cpp's slots
(``slot_cache.py``) and the positions of cached prefixes leaving the PyTorch runner's paged pool
(``paged_cache.py``). A prompt that a state covers further than the cache's own tree gets a
:class:`~.saved_state.TieredMatch`, and the cache restores the state instead of computing
(what a saved state is, what matches one, and when one is worth saving: ``saved_state.py``).

States live in host RAM (a budget in bytes, least recently used out first) and, with a
directory, on disk beneath it (``disk_tier.py``): a state leaving RAM is written there and
stays matchable; a hit on it reads it back into RAM. At start the tree is rebuilt from the
directory's states of the same model, and ``persist`` writes what is only in RAM at shutdown.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.prefix_cache.disk_tier import DiskTier
from slotserve.engine.prefix_cache.radix_tree import RadixTree
from slotserve.engine.prefix_cache.saved_state import HostMatch, HostNode, SavedState, TieredMatch
from slotserve.engine.prefix_cache.state_directory import DiskEntry
from slotserve.engine.prefix_cache.tier_figures import HostTierCounters, tier_figures
from slotserve.engine.prefix_cache.tree_node import Match

R = TypeVar("R")  # what a cache's restore returns on success


def _state_ends_below(value: SavedState | None, k: int) -> tuple[None, SavedState | None]:
    return None, value


class HostTier:
    """Engine-thread only. ``disk_dir``: the directory of the disk tier beneath RAM (None:
    none), whose files are this ``fingerprint``'s (the model's, runner's and KV layout's)."""

    def __init__(
        self,
        budget_bytes: int,
        disk_dir: Path | None = None,
        fingerprint: str = "",
        disk_budget_bytes: int = 0,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.tree: RadixTree[SavedState | None] = RadixTree(lambda: None, _state_ends_below)
        self.bytes = 0  # of the states in RAM
        self.entries = 0  # states, in RAM or on disk
        self.counters = HostTierCounters()
        self._in_ram: OrderedDict[HostNode, None] = OrderedDict()  # least recently used first
        self._on_disk: dict[tuple[int, ...], HostNode] = {}
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            self.disk = DiskTier(
                disk_dir, fingerprint, disk_budget_bytes, on_drop=self._dropped_from_disk
            )
            for entry in self.disk.entries():  # least recently used first
                self._index(entry)

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> HostMatch | None:
        """The longest prefix of ``tokens`` a saved state covers; None when none does."""
        found = self.tree.match_prefix(tokens)
        if found.length == 0:
            return None
        leaves = [n for n in self.tree.subtree(found.node) if n.value is not None]
        return HostMatch(min(leaves, key=lambda n: n.end), found.length)

    def tiered(self, found: Match[Any], prompt: Sequence[int], policy: ChunkPolicy) -> Match[Any]:
        """``found`` (the tree's match of ``prompt`` without its last token), or a
        :class:`TieredMatch` when a saved state lets more of the prompt be reused."""
        saved = self.match(prompt[: len(prompt) - 1])
        reusable = policy.reusable_length
        if saved is None or reusable(saved.length, len(prompt)) <= reusable(
            found.length, len(prompt)
        ):
            return found
        return TieredMatch(found.node, saved.length, in_tree=found.length, saved=saved)

    def covers(self, path: Sequence[int]) -> bool:
        """True when a saved state already holds every token of ``path``."""
        return self.tree.match_prefix(path).length == len(path)

    def load(self, match: HostMatch) -> tuple[bytearray, bool] | None:
        """The bytes of the state at ``match.leaf`` and whether they came from disk (they are
        then kept in RAM again); None when its file is gone or damaged (the state is then
        forgotten)."""
        leaf, state = match.leaf, match.leaf.value
        assert state is not None, "loading from a node without a saved state"
        if state.data is not None:
            self._in_ram.move_to_end(leaf)
            return state.data, False
        assert self.disk is not None and state.on_disk is not None
        data = self.disk.read(state.on_disk)  # a bad file reaches _dropped_from_disk
        if data is None:
            return None
        if len(data) <= self.budget_bytes:
            state.data = data
            self.bytes += len(data)
            self._in_ram[leaf] = None
            self._evict_ram(keep=leaf)
        return data, True

    # ---- saving -------------------------------------------------------------------------------

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
        node = self._insert(path, SavedState(data))
        self.bytes += len(data)
        self._in_ram[node] = None
        self.counters.saves += 1
        self.counters.saved_tokens += len(path)
        self._evict_ram()
        return True

    def persist(self) -> int:
        """Writes every state only in RAM to the disk tier (at shutdown); returns how many."""
        written = 0
        if self.disk is None:
            return written
        for node in list(self._in_ram):
            state = node.value
            if state is not None and state.on_disk is None and self._write(node, state):
                written += 1
        return written

    def restore(
        self, match: HostMatch, tokens: int, write: Callable[[bytearray], R | None]
    ) -> R | None:
        """Loads the state at ``match`` and hands its bytes to ``write``, which puts them into
        the runner's KV and returns None when it could not. A write that succeeds counts a hit
        of ``tokens``, timed from the load. None when the state could not be read."""
        started = time.perf_counter()
        loaded = self.load(match)
        if loaded is None:
            return None
        data, from_disk = loaded
        written = write(data)
        if written is None:
            return None
        self.counters.hits += 1
        self.counters.hit_tokens += tokens
        self.counters.restore_seconds += time.perf_counter() - started
        if from_disk:
            self.counters.disk_hits += 1
            self.counters.disk_hit_tokens += tokens
        return written

    def stat_fields(self) -> dict[str, Any]:
        """This tier's figures, named as :class:`PrefixCacheStats` names them."""
        return tier_figures(self.counters, self.budget_bytes, self.bytes, self.entries, self.disk)

    def clear(self) -> int:
        """Drops every saved state, files included; returns the tokens they covered."""
        freed = 0
        for node in [n for n in self.tree.subtree(self.tree.root) if n.value is not None]:
            freed += node.end
            self._forget(node)
        if self.disk is not None:
            self.disk.clear()
        return freed

    # ---- bookkeeping --------------------------------------------------------------------------

    def _insert(self, path: Sequence[int], state: SavedState) -> HostNode:
        node = self.tree.insert(path)
        assert node.value is None and node.is_leaf, "a covered path was saved twice"
        # States of the path's own prefixes are covered by this one now.
        walk = node.parent
        while walk is not None and walk.parent is not None:
            if walk.value is not None:
                self._forget(walk)
            walk = walk.parent
        node.value = state
        self.entries += 1
        if state.on_disk is not None:
            self._on_disk[state.on_disk.tokens] = node
        return node

    def _index(self, entry: DiskEntry) -> None:
        """Makes a state found on disk at start matchable."""
        assert self.disk is not None
        path = list(entry.tokens)  # the tree compares edges as lists: a tuple never matches
        if self.covers(path):
            self.disk.remove(entry)  # a longer state holds all of it
            return
        self._insert(path, SavedState(None, entry))

    def _evict_ram(self, keep: HostNode | None = None) -> None:
        """Moves the least recently used states out of RAM until the rest fit the budget:
        to disk when there is one (they stay matchable), else out of the tier."""
        for node in list(self._in_ram):
            if self.bytes <= self.budget_bytes:
                return
            state = node.value
            if node is keep or state is None or state.data is None:
                continue
            if state.on_disk is None and self.disk is not None:
                self._write(node, state)
            self.bytes -= len(state.data)
            state.data = None
            del self._in_ram[node]
            self.counters.evictions += 1
            if state.on_disk is None:
                self._forget(node)

    def _write(self, node: HostNode, state: SavedState) -> bool:
        assert self.disk is not None and state.data is not None
        entry = self.disk.write(self.tree.path_tokens(node), state.data)
        if entry is None:
            return False
        state.on_disk = entry
        self._on_disk[entry.tokens] = node
        return True

    def _dropped_from_disk(self, entry: DiskEntry) -> None:
        """The disk tier evicted a file or found it bad: a state only there is gone."""
        node = self._on_disk.pop(entry.tokens, None)
        if node is None or node.value is None:
            return
        node.value.on_disk = None
        if node.value.data is None:
            self._forget(node)

    def _forget(self, node: HostNode) -> None:
        """Drops a node's state wherever it is kept, and the node if nothing else needs it."""
        state = node.value
        assert state is not None
        node.value = None
        self.entries -= 1
        if state.data is not None:
            self.bytes -= len(state.data)
            self._in_ram.pop(node, None)
        if state.on_disk is not None:
            self._on_disk.pop(state.on_disk.tokens, None)
            if self.disk is not None:
                self.disk.remove(state.on_disk)
        self.tree.prune(node)

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` when the tree, the RAM and disk indexes and the counts
        disagree."""
        self.tree.check_integrity()
        nodes = [n for n in self.tree.subtree(self.tree.root) if n.value is not None]
        assert len(nodes) == self.entries, f"{len(nodes)} saved states, count {self.entries}"
        in_ram = [n for n in nodes if n.value is not None and n.value.data is not None]
        assert set(in_ram) == set(self._in_ram), "the RAM order and the states disagree"
        total = sum(len(n.value.data) for n in in_ram if n.value and n.value.data is not None)
        assert total == self.bytes, f"states in RAM take {total} bytes, count {self.bytes}"
        on_disk = {n.value.on_disk.tokens: n for n in nodes if n.value and n.value.on_disk}
        assert on_disk == self._on_disk, "the disk index and the states disagree"
        for node in nodes:
            state = node.value
            assert state is not None and node.is_leaf, f"a state ends inside ({node.end})"
            assert state.data is not None or state.on_disk is not None, "a state kept nowhere"
            if state.on_disk is not None:
                assert self.disk is not None and self.disk.get(state.on_disk.tokens) is not None
