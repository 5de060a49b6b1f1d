"""The prefix cache's interface, the radix-tree cache both implementations build on, and the
cache that is off. Its figures: ``stats.py``.

Three implementations, one per way a runner keeps KV:

* :class:`~.slot_cache.SlotPrefixCache`: KV per sequence id, each slot
  one stream (llama.cpp). Free slots keep their KV and are the cache's storage; a hit trims a
  free slot in place or copies the prefix between streams.
* :class:`~.paged_cache.PagedPrefixCache`: a pool of KV blocks shared by
  reference (the PyTorch runner). The radix tree holds the blocks of cached prefixes itself, so
  cache capacity follows free memory, not the slot count, and a prefix outlives its owner
  without a copy.
* :class:`NullPrefixCache`: matches nothing, keeps nothing, and says why it is off.

Rules every implementation keeps (the scheduler relies on them):

* ``attach`` before a sequence runs, then ``extend`` after each prefill chunk and ``release``
  (or ``drop``, after a failure) when it ends or is preempted. Between ``attach`` and the end
  the slot is *running* and its path is locked: never evicted.
* A hit never covers the last prompt token, and never more than the runner's chunk policy
  allows (:meth:`~slotserve.engine.chunk_policy.ChunkPolicy.reusable_length`).
* ``evict_unused`` gives back some unused KV whatever the budget (0: nothing left to give);
  cached content never makes a request wait or fail.
* ``check_integrity`` raises ``AssertionError`` when the tree, the locks or the runner's KV
  disagree (run by tests and whenever the engine goes idle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.prefix_cache.host_tier import HostTier
from slotserve.engine.prefix_cache.radix_tree import RadixTree
from slotserve.engine.prefix_cache.state_snapshots import SnapshotBook
from slotserve.engine.prefix_cache.stats import PrefixCacheStats
from slotserve.engine.prefix_cache.tree_node import Match, TreeNode
from slotserve.engine.runner_interface import Runner

H = TypeVar("H")  # what a tree node holds: the runner's handle to the node's KV

PrefixMatch = Match[Any]


@dataclass(frozen=True)
class Arrival:
    """A sequence taking a free slot: its cache keys ``tokens`` and what ``match`` found of
    them. A preempted sequence coming back is ``resumed`` (the hit statistics count a lookup
    once) and says how many of ``tokens`` are prompt, the rest being its output so far."""

    tokens: Sequence[int]
    match: PrefixMatch
    resumed: bool = False
    num_prompt_tokens: int | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) if self.num_prompt_tokens is None else self.num_prompt_tokens


class PrefixCache(Protocol):
    """What the scheduler and the engine core ask of a prefix cache (engine thread only)."""

    @property
    def enabled(self) -> bool: ...

    def match(self, prompt: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``prompt`` without its last token."""
        ...

    def choose_slot(self, match: PrefixMatch, prompt_length: int, free_slots: Sequence[int]) -> int:
        """The free slot a sequence with this match should take."""
        ...

    def attach(self, slot: int, arrival: Arrival) -> int:
        """Makes free ``slot``'s KV hold the reusable part of the arrival's match and marks
        the slot running; returns how many tokens need no computing."""
        ...

    def extend(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        """Running ``slot``'s KV now starts with ``cacheable_tokens``: shareable at once."""
        ...

    def release(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        """The slot's sequence ended or was preempted: ``cacheable_tokens`` stay cached, the
        slot's own hold on its KV goes."""
        ...

    def drop(self, slot: int) -> None:
        """Forgets and frees the slot's KV (its content is unknown after a failure)."""
        ...

    def is_running(self, slot: int) -> bool: ...

    def keep_state_at(self, slot: int, position: int, computed: int) -> None:
        """Another prompt will resume at ``position`` of running ``slot``'s prompt (computed
        up to ``computed``): a cache that needs a saved state there asks for one."""
        ...

    def evict_unused(self) -> int: ...

    def flush(self) -> int:
        """Evicts every cached prefix no running sequence uses; returns the tokens freed."""
        ...

    def persist(self) -> int:
        """At shutdown: saves what a next start can reuse (a disk tier); returns states."""
        ...

    def held_tokens(self, slot: int) -> list[int]:
        """The token prefix the cache records for ``slot``'s KV."""
        ...

    def stats(self) -> PrefixCacheStats: ...

    def check_integrity(self, running_tokens: Mapping[int, int]) -> None:
        """``running_tokens`` maps each running slot to the tokens its KV must hold."""
        ...


class TreePrefixCache(Generic[H]):
    """What the caches that are on share: the radix tree, its budget, the hit and eviction
    counters, the lookup (never covering the last prompt token), LRU eviction, and the saved
    states behind the tree (``host``, set by a subclass whose runner can save them). A subclass
    says how a node's KV is given back (:meth:`_give_back`)."""

    def __init__(
        self,
        tree: RadixTree[H],
        policy: ChunkPolicy,
        budget_tokens: int,
        kv_bytes_per_token: int,
    ) -> None:
        self.tree = tree
        self.policy = policy
        self.budget_tokens = budget_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.hits = self.misses = self.query_tokens = self.hit_tokens = 0
        self.evictions = self.evicted_tokens = 0
        self.host: HostTier | None = None
        self.snapshots: SnapshotBook | None = None

    @property
    def enabled(self) -> bool:
        return True

    def match(self, prompt: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``prompt`` without its last token, in the tree or, when
        a saved state covers more of it, in the host tier (a ``TieredMatch``)."""
        found = self.tree.match_prefix(prompt[: len(prompt) - 1])
        return found if self.host is None else self.host.tiered(found, prompt, self.policy)

    def evict_unused(self) -> int:
        """Gives back the least recently used unlocked leaf whatever the budget; returns the
        tokens freed (0: nothing is left to give back)."""
        return self._evict(1)

    def flush(self) -> int:
        """Evicts every unused cached prefix, saved states included; returns the tokens."""
        host, self.host = self.host, None  # what a flush evicts is not saved
        freed = 0
        try:
            while evicted := self.evict_unused():
                freed += evicted
        finally:
            self.host = host
        return freed + (host.clear() if host is not None else 0)

    def persist(self) -> int:
        """Saves every cached prefix to the disk tier, if there is one (at shutdown: the next
        start with the same model finds them); returns the states written."""
        host = self.host
        if host is None or host.disk is None:
            return 0
        for node in list(self.tree.subtree(self.tree.root)):
            if node.parent is not None and node.is_leaf:
                self._save_leaf(node)
        return host.persist()

    def _save_leaf(self, node: TreeNode[H]) -> None:
        """Saves the KV of a leaf's whole path to the host tier (a cache with one says how)."""
        raise NotImplementedError

    def keep_state_at(self, slot: int, position: int, computed: int) -> None:
        pass

    def _count_lookup(self, prompt_length: int, reused: int) -> None:
        self.query_tokens += prompt_length
        self.hit_tokens += reused
        if reused:
            self.hits += 1
        else:
            self.misses += 1

    def _evict_over_budget(self) -> None:
        excess = self.tree.evictable_tokens - self.budget_tokens
        if excess > 0:
            self._evict(excess)

    def _evict(self, num_tokens: int) -> int:
        evicted = self.tree.evict(num_tokens, self._give_back)
        self.evicted_tokens += evicted
        return evicted

    def _give_back(self, node: TreeNode[H]) -> None:
        """Frees an evicted node's KV (the tree then drops the node)."""
        raise NotImplementedError

    def stats(self) -> PrefixCacheStats:
        tree, bytes_per_token = self.tree, self.kv_bytes_per_token
        tiers = {} if self.host is None else self.host.stat_fields()
        if self.snapshots is not None:
            tiers |= self.snapshots.stat_fields()
        return PrefixCacheStats(
            enabled=True,
            hits=self.hits,
            misses=self.misses,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            cached_tokens=tree.total_tokens,
            evictable_tokens=tree.evictable_tokens,
            cached_bytes=tree.total_tokens * bytes_per_token,
            nodes=tree.num_nodes,
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            budget_tokens=self.budget_tokens,
            kv_bytes_per_token=bytes_per_token,
            **tiers,
        )


class NullPrefixCache:
    """The cache that is off: matches nothing, keeps nothing; a slot's KV is freed when its
    sequence ends. ``disabled_reason`` says why (configuration, or the model)."""

    def __init__(self, runner: Runner, num_slots: int, disabled_reason: str) -> None:
        self.kv = runner
        self.num_slots = num_slots
        self.disabled_reason = disabled_reason
        self._nothing: TreeNode[None] = TreeNode(key=[], value=None, parent=None, end=0)
        self._running: set[int] = set()

    @property
    def enabled(self) -> bool:
        return False

    def match(self, prompt: Sequence[int]) -> PrefixMatch:
        return Match(self._nothing, 0)

    def choose_slot(self, match: PrefixMatch, prompt_length: int, free_slots: Sequence[int]) -> int:
        return min(free_slots)

    def attach(self, slot: int, arrival: Arrival) -> int:
        self._running.add(slot)
        return 0

    def extend(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        pass

    def release(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        self.drop(slot)

    def drop(self, slot: int) -> None:
        self._running.discard(slot)
        self.kv.trim_kv(slot, 0)

    def is_running(self, slot: int) -> bool:
        return slot in self._running

    def keep_state_at(self, slot: int, position: int, computed: int) -> None:
        pass

    def evict_unused(self) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def persist(self) -> int:
        return 0

    def held_tokens(self, slot: int) -> list[int]:
        return []

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(False, self.disabled_reason)

    def check_integrity(self, running_tokens: Mapping[int, int]) -> None:
        assert set(running_tokens) == self._running, (
            f"running slots {sorted(running_tokens)}, cache thinks {sorted(self._running)}"
        )
        for slot in range(self.num_slots):
            held = self.kv.kv_tokens(slot)
            expected = running_tokens.get(slot, 0)
            assert held == expected, f"slot {slot} KV holds {held}, expected {expected}"
