"""The prefix cache over a paged KV pool (the PyTorch runner): the radix tree owns the
KV blocks of cached prefixes. The interface and its rules: ``base.py``.

Each tree node's handle is a :class:`BlockSpan`: the pool blocks covering the node's token
positions, which the tree *holds* (a reference of its own in the block tables). A cached prefix
therefore outlives the sequence that computed it without a copy, and cache capacity follows
free KV memory, not the number of slots: a free slot holds no KV at all.

Nodes end at any token, not only at block boundaries (``block_span.py``: which blocks hold a
node's positions, and how a match assembles a slot's table from them). The slot shares those
blocks; the runner copies a shared block before writing into it.

* **Attach**: share the matched path's blocks into the slot (no KV copied), lock its end.
* **Extend** (after each prefill chunk): insert the computed prompt up to a block boundary, so
  requests queued behind can share it at once without the running slot's next write having
  to copy a shared block.
* **Release**: insert every cacheable token (the tree takes holds on the new nodes' blocks),
  unlock, and drop the slot's own references: the blocks stay in the pool as cache.
* **Evict**: the least recently used unlocked leaves give up their holds (heap kept by the
  tree); under pool pressure ``evict_unused`` frees one leaf at a time, whatever the budget.

A model with recurrent layers also needs their state where a hit resumes: ``snapshots``
(``state_snapshots.py``) ties copies of it to nodes, and a hit ends at the deepest of them.

With a host tier (``host_tier.py``, a runner that can copy positions out of its pool and back):

* **Evict** first saves the leaf's whole path (its positions ``0 .. end - 1``) to host RAM, and
  from there to disk, unless a saved state covers it already or too few tokens would go.
* **Attach** of a prompt that a saved state covers further than the tree: the tree's whole
  blocks are shared as usual, fresh blocks are reserved for the rest (unused cache is evicted
  to make room), and the state's positions are written into them; the restored positions are
  then the tree's like any computed ones.
* **Persist** (at shutdown) saves every leaf's path, so the disk holds the whole tree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.prefix_cache.base import Arrival, PrefixMatch, TreePrefixCache
from slotserve.engine.prefix_cache.block_span import (
    BlockSpan,
    check_span,
    node_span,
    path_blocks,
    split_span,
)
from slotserve.engine.prefix_cache.host_tier import HostTier
from slotserve.engine.prefix_cache.radix_tree import RadixTree
from slotserve.engine.prefix_cache.runner_kv import SavablePagedKv, SlotKv
from slotserve.engine.prefix_cache.saved_state import TieredMatch, worth_saving
from slotserve.engine.prefix_cache.state_snapshots import SnapshotBook
from slotserve.engine.prefix_cache.tree_node import TreeNode
from slotserve.engine.runner_interface import PagedKv


class PagedPrefixCache(TreePrefixCache[BlockSpan]):
    """Engine-thread only. Slots are the runner's sequence ids ``0 .. num_slots - 1``."""

    def __init__(
        self,
        kv: SlotKv,
        paged: PagedKv,
        num_slots: int,
        policy: ChunkPolicy,
        budget_tokens: int,
        kv_bytes_per_token: int,
        snapshots: SnapshotBook | None = None,
        host: HostTier | None = None,
    ) -> None:
        tree: RadixTree[BlockSpan] = RadixTree(BlockSpan, self._split_span)
        super().__init__(tree, policy, budget_tokens, kv_bytes_per_token)
        self.kv = kv
        self.paged = paged
        self.block_size = paged.block_size
        self.num_slots = num_slots
        self.snapshots = snapshots
        # A saved state has no recurrent state beside it: the tiers are for attention-only KV.
        assert host is None or snapshots is None, "a host tier for a model with recurrent state"
        self.host = host if isinstance(kv, SavablePagedKv) else None
        self._end: dict[int, TreeNode[BlockSpan]] = {}  # running slot -> its locked path's end

    # ---- admission --------------------------------------------------------------------------

    def choose_slot(self, match: PrefixMatch, prompt_length: int, free_slots: Sequence[int]) -> int:
        return min(free_slots)  # free slots hold nothing: any will do

    def attach(self, slot: int, arrival: Arrival) -> int:
        assert slot not in self._end, f"slot {slot} is already running"
        tokens, match, count = arrival.tokens, arrival.match, not arrival.resumed
        reusable = self.policy.reusable_length
        length = reusable(match.length, len(tokens))
        if isinstance(match, TieredMatch):
            restored = self._restore(slot, tokens, match, length)
            if restored is not None:
                return self._attached(slot, restored, len(tokens), length, count)
            match = self.tree.match_prefix(tokens[: len(tokens) - 1])  # the tree's part only
            length = reusable(match.length, len(tokens))
        node = match.node
        book = self.snapshots
        if book is not None:  # resume where the recurrent state was kept, if anywhere
            kept = book.deepest(node, length)
            node, length = (kept, kept.end) if kept is not None else (self.tree.root, 0)
        if node.end != length:
            # The match ends inside a node's edge (or the policy reuses less of it): lock a
            # node ending exactly at the reused tokens (the edge is split), so the slot's
            # path never claims positions it has not computed.
            node = self.tree.insert(tokens[:length])
        if length:
            self.paged.share(slot, path_blocks(node, length, self.block_size), length)
        self._attached(slot, node, len(tokens), length, count)
        if book is not None:
            if length:
                book.runner.restore_state(slot, book.at_node[node])
            cacheable = self.policy.cacheable_length(arrival.prompt_length, len(tokens))
            book.plan(slot, length, match.length, cacheable)
        return length

    def _attached(
        self, slot: int, node: TreeNode[BlockSpan], num_tokens: int, length: int, count: bool
    ) -> int:
        self._end[slot] = node
        self.tree.lock(node)
        if count:
            self._count_lookup(num_tokens, length)
        return length

    def _restore(
        self, slot: int, tokens: Sequence[int], match: TieredMatch, length: int
    ) -> TreeNode[BlockSpan] | None:
        """Makes free ``slot`` hold the first ``length`` tokens of ``tokens``: the tree's whole
        blocks shared, the rest written from the saved state. Returns the node ending at
        ``length`` (holding the written blocks), or None, with the slot empty, when the state
        could not be read, the pool has no room or the runner refused the state."""
        host, kv = self.host, self.kv
        assert host is not None and match.saved is not None and isinstance(kv, SavablePagedKv)
        shared = min(match.in_tree, length) // self.block_size * self.block_size

        def write(data: bytearray) -> TreeNode[BlockSpan] | None:
            if shared:
                self.paged.share(slot, path_blocks(match.node, shared, self.block_size), shared)
            # The slot's references keep the shared blocks whatever is evicted to make room.
            while not kv.reserve_kv(slot, length):
                if self.evict_unused() == 0:
                    kv.trim_kv(slot, 0)
                    return None
            if not kv.restore_kv_blocks(slot, shared, length, data):
                kv.trim_kv(slot, 0)
                return None
            return self._place(slot, tokens[:length])

        return host.restore(match.saved, length, write)

    # ---- progress and end -------------------------------------------------------------------

    def extend(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        whole_blocks = len(cacheable_tokens) // self.block_size * self.block_size
        self._insert(slot, cacheable_tokens[:whole_blocks])

    def release(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        self._insert(slot, cacheable_tokens)
        self.tree.unlock(self._end.pop(slot))
        if self.snapshots is not None:
            self.snapshots.forget_slot(slot)
        self.kv.trim_kv(slot, 0)
        self._evict_over_budget()

    def drop(self, slot: int) -> None:
        node = self._end.pop(slot, None)
        if node is not None:
            self.tree.unlock(node)
        if self.snapshots is not None:
            self.snapshots.forget_slot(slot)
        self.kv.trim_kv(slot, 0)

    def is_running(self, slot: int) -> bool:
        return slot in self._end

    def keep_state_at(self, slot: int, position: int, computed: int) -> None:
        if self.snapshots is not None and slot in self._end:
            self.snapshots.plan_one(slot, position, computed)

    def _insert(self, slot: int, tokens: Sequence[int]) -> None:
        """Records running ``slot``'s first ``tokens`` (computed) and moves its lock there;
        the snapshots its prompt has filled go to the nodes ending where they were taken."""
        assert slot in self._end, f"slot {slot} is not running"
        if self.snapshots is not None:
            for position, snapshot in self.snapshots.reached(slot, len(tokens)):
                self.snapshots.keep(self._place(slot, tokens[:position]), snapshot)
        node = self._place(slot, tokens)
        old = self._end[slot]
        if node is not old:
            self.tree.lock(node)
            self.tree.unlock(old)
            self._end[slot] = node

    def _place(self, slot: int, tokens: Sequence[int]) -> TreeNode[BlockSpan]:
        """The node ending at ``tokens`` (computed by running ``slot``); a new leaf holds the
        slot's blocks for its positions."""
        node = self.tree.insert(tokens)
        if node.parent is not None and not node.value:
            span = node_span(node, self.paged.table(slot), self.block_size)
            self.paged.hold(span.blocks)
            node.value = span
        return node

    def _split_span(self, span: BlockSpan, k: int) -> tuple[BlockSpan, BlockSpan]:
        """Divides a node's blocks at its ``k``-th token; a block holding both sides' positions
        goes to both (held once more)."""
        upper, lower = split_span(span, k, self.block_size)
        if lower.start % self.block_size:  # the cut falls inside a block: both sides hold it
            self.paged.hold([lower.blocks[0]])
        return upper, lower

    def _give_back(self, node: TreeNode[BlockSpan]) -> None:
        if self.host is not None and worth_saving(len(node.key), node.end):
            self._save_path(node)
        self.paged.unhold(node.value.blocks)
        node.value.blocks = []
        if self.snapshots is not None:
            self.snapshots.release_node(node)
        self.evictions += 1

    def _save_path(self, node: TreeNode[BlockSpan]) -> None:
        """Saves the positions of the path to ``node`` to the host tier (unless covered)."""
        kv, host = self.kv, self.host
        assert host is not None and isinstance(kv, SavablePagedKv)
        blocks = path_blocks(node, node.end, self.block_size)
        host.save(self.tree.path_tokens(node), lambda: kv.save_kv_blocks(blocks, node.end))

    def _save_leaf(self, node: TreeNode[BlockSpan]) -> None:
        if node.value:
            self._save_path(node)

    # ---- inspection -------------------------------------------------------------------------

    def held_tokens(self, slot: int) -> list[int]:
        node = self._end.get(slot)
        return [] if node is None else self.tree.path_tokens(node)

    def check_integrity(self, running_tokens: Mapping[int, int]) -> None:
        """Beyond the tree's own rules: each node's span covers exactly its positions, the pool's
        holds are the tree's, running slots hold their computed tokens and free slots none."""
        self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        assert set(running_tokens) == set(self._end), (
            f"running slots {sorted(running_tokens)}, cache thinks {sorted(self._end)}"
        )
        assert self.tree.root.lock_ref == len(self._end), "root lock_ref != running slots"
        held: Counter[int] = Counter()
        for node in self.tree.subtree(self.tree.root):
            if node.parent is None:
                continue
            check_span(node, self.block_size)
            held.update(node.value.blocks)
        self.paged.check_integrity(held)
        if self.snapshots is not None:
            nodes = list(self.tree.subtree(self.tree.root))
            self.snapshots.check_integrity(nodes, running_tokens)
        for slot in range(self.num_slots):
            tokens = self.kv.kv_tokens(slot)
            expected = running_tokens.get(slot, 0)
            assert tokens == expected, f"slot {slot} KV holds {tokens} tokens, expected {expected}"
            if slot in self._end:
                assert self._end[slot].end <= expected, f"slot {slot} claims uncomputed tokens"
