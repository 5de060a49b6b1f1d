"""Recurrent-state snapshots for the prefix cache (models with recurrent layers: Gated DeltaNet,
Mamba...), on either runner's KV.

Such a model's KV blocks are not enough to resume a prompt: its recurrent layers carry one
state through every position, which no prefix of positions can be cut from. The runner
therefore copies the state, when a prompt's chunk reaches chosen positions, into numbered
places (:class:`~slotserve.engine.kv_layouts.StateSnapshots`), and the cache ties each
copy to the tree node ending at that position. A hit resumes from the deepest node of the
matched path that has one; the KV blocks before it are shared as for any model.

Which positions. Only multiples of the chunk grain, where the state is the same for every
prompt through that prefix (the policy is ``anchored``), and only prompt positions (decoded
tokens are computed another way). For each prompt, those past its hit:

* its last multiple of the grain (the next turn of a conversation resends the prompt and
  resumes there);
* where it leaves the cached path it matched (the next prompt sharing that prefix, such as
  another conversation over the same system prompt, branches there too);
* where a prompt waiting for this one will resume (the scheduler says so);
* every ``interval`` positions, for prefixes that a later prompt may share.

Places are few: when none is free, the least recently used snapshot of an unlocked node is
taken back (its node keeps its KV blocks); a node evicted from the tree frees its snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slotserve.engine.prefix_cache.tree_node import TreeNode
from slotserve.engine.runner_interface import StateSnapshots

Node = TreeNode[Any]


class SnapshotBook:
    """Engine-thread only: which node holds which snapshot, the free places, and the places
    each running slot's prompt will fill."""

    def __init__(self, runner: StateSnapshots, interval: int, grain: int) -> None:
        self.runner = runner
        self.capacity = runner.snapshot_capacity
        self.bytes_each = runner.snapshot_bytes
        self.interval = max(grain, interval // grain * grain)
        self.grain = grain
        self._free = list(range(self.capacity - 1, -1, -1))
        self.at_node: dict[Node, int] = {}
        self._pending: dict[int, dict[int, int]] = {}  # slot -> {position: snapshot}
        self.saves = 0  # snapshots filled and kept
        self.taken_back = 0  # snapshots reused for another position before their node went

    def deepest(self, node: Node, limit: int) -> Node | None:
        """The deepest node on the path to ``node`` that ends at most at ``limit`` and holds a
        snapshot."""
        walk: Node | None = node
        while walk is not None and walk.parent is not None:
            if walk.end <= limit and walk in self.at_node:
                return walk
            walk = walk.parent
        return None

    def plan(self, slot: int, reused: int, matched: int, cacheable: int) -> None:
        """Asks the runner to save ``slot``'s state at the positions worth keeping past
        ``reused`` (the hit): most valuable first, while places can be found."""
        grain = self.grain
        branch = min(matched, cacheable) // grain * grain
        spaced = range(cacheable // self.interval * self.interval, reused, -self.interval)
        positions = dict.fromkeys([cacheable, branch, *spaced])  # ordered, no duplicates
        for position in positions:
            if not self._ask(slot, position, reused):
                break

    def plan_one(self, slot: int, position: int, computed: int) -> None:
        """One more position for running ``slot``, computed up to ``computed``: where a
        prompt waiting for it will resume (rounded down to the grain)."""
        self._ask(slot, position // self.grain * self.grain, computed)

    def _ask(self, slot: int, position: int, computed: int) -> bool:
        """Has the runner save ``slot``'s state at ``position`` unless it is passed or already
        asked for; False when no place can be found."""
        planned = self._pending.setdefault(slot, {})
        if position <= computed or position in planned:
            return True
        snapshot = self._allocate()
        if snapshot is None:
            return False
        planned[position] = snapshot
        self.runner.save_state(slot, position, snapshot)
        return True

    def reached(self, slot: int, length: int) -> list[tuple[int, int]]:
        """The planned (position, snapshot) of ``slot`` that its computed prompt now covers,
        in order: filled by the runner, for the cache to tie to nodes."""
        planned = self._pending.get(slot)
        if not planned:
            return []
        done = sorted((p, s) for p, s in planned.items() if p <= length)
        for position, _ in done:
            del planned[position]
        return done

    def keep(self, node: Node, snapshot: int) -> None:
        """Ties a filled snapshot to the node ending at its position (a node that has one
        already keeps it: the new copy holds the same state)."""
        if node in self.at_node:
            self._free.append(snapshot)
            return
        self.at_node[node] = snapshot
        self.saves += 1

    def forget_slot(self, slot: int) -> None:
        """The slot stopped before reaching its planned positions: their places are free."""
        for snapshot in self._pending.pop(slot, {}).values():
            self._free.append(snapshot)

    def release_node(self, node: Node) -> None:
        snapshot = self.at_node.pop(node, None)
        if snapshot is not None:
            self._free.append(snapshot)

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        unlocked = [node for node in self.at_node if node.lock_ref == 0]
        if not unlocked:
            return None
        oldest = min(unlocked, key=lambda node: node.last_access)
        self.taken_back += 1
        return self.at_node.pop(oldest)

    @property
    def num_snapshots(self) -> int:
        return len(self.at_node)

    def stat_fields(self) -> dict[str, int]:
        """The book's figures, named as :class:`PrefixCacheStats` names them."""
        return {
            "snapshot_capacity": self.capacity,
            "snapshots": self.num_snapshots,
            "snapshot_bytes": self.bytes_each,
            "snapshot_interval": self.interval,
            "snapshot_saves": self.saves,
            "snapshot_taken_back": self.taken_back,
        }

    def check_integrity(self, tree_nodes: Sequence[Node], running: Mapping[int, object]) -> None:
        """Every place is free, kept by a node of the tree, or planned by a running slot, once."""
        alive = set(tree_nodes)
        assert all(node in alive for node in self.at_node), "a snapshot of a node not in the tree"
        assert set(self._pending) <= set(running), "snapshots planned for a slot not running"
        places = (
            list(self._free)
            + list(self.at_node.values())
            + [s for planned in self._pending.values() for s in planned.values()]
        )
        assert sorted(places) == list(range(self.capacity)), f"snapshot places: {places}"
        for node in self.at_node:
            assert node.end % self.grain == 0, f"a snapshot at {node.end}, off the grain"
