"""The prefix cache over per-slot KV streams (the llama.cpp runner): which slot holds
which token prefix, and reuse of it. The interface and its rules: ``base.py``.

The runner keeps KV per sequence id (a slot index): positions ``0 .. n-1`` of one token list.
It can copy the first ``n`` positions of one sequence into another and trim a sequence to its
first ``n`` positions (``runner_kv.KvStore``), as llama.cpp does on its per-sequence KV streams.

On that model the cache keeps a radix tree of the slots' streams, each slot ending at a node
(``slot_streams.py``). A slot keeps its KV after its sequence ends: free slots are the cache's
storage, running slots lock their own path.

* **Admission**: the longest cached prefix of the prompt is matched (never the whole prompt:
  the last token is always computed, so the sequence gets logits; with a prefill grain, see
  ``ChunkPolicy.reusable_length``). The new sequence takes, in
  order of preference, a free slot that already holds the prefix (trimmed in place, no copy), or
  the free slot whose content is least worth keeping, into which the prefix is copied from any
  holder, running or free.
* **Progress**: after each prefill chunk the computed prompt is inserted, so requests queued
  behind a long prompt can share it while it is still running.
* **End**: the computed tokens the cache may hand out (``ChunkPolicy.cacheable_length``)
  are inserted, the slot's KV is trimmed to them, and the path is unlocked.
* **Budget**: unlocked (cached) tokens beyond the budget are evicted, least recently used
  leaves first, by trimming the free slots that hold them. Running sequences never wait for the
  cache: a slot's cached content gives way the moment a new sequence needs the slot.
* **Host tier** (``host_tier.py``, a runner that can save a sequence's state): content a slot is
  about to lose (eviction, reuse of the slot, an in-place hit cutting its tail) is saved to
  host memory first unless another slot or a saved state still holds it. A prompt that a saved
  state covers further than any slot has it restored into the slot it takes, then trimmed to
  the reusable length, instead of copying a shorter prefix and computing the rest.
* **Recurrent state** (``state_snapshots.py``, a hybrid model): a stream's recurrent state
  covers all its positions and cannot be trimmed to fewer, so a hit resumes only at a node
  holding a snapshot: the stream is copied whole, given the snapshot's state, then trimmed to
  its position. A free slot's end moves up to the deepest snapshot on its path (attention KV
  past it is never resumed from), with that state.
"""

from __future__ import annotations

from collections.abc import Sequence

from slotserve.engine.prefix_cache.base import Arrival, PrefixMatch
from slotserve.engine.prefix_cache.runner_kv import SavableKvStore
from slotserve.engine.prefix_cache.saved_state import TieredMatch, worth_saving
from slotserve.engine.prefix_cache.slot_streams import CacheNode, SlotStreams


class SlotPrefixCache(SlotStreams):
    """Engine-thread only. Slots are the runner's sequence ids ``0 .. num_slots - 1``."""

    # ---- admission --------------------------------------------------------------------------

    def choose_slot(self, match: PrefixMatch, prompt_length: int, free_slots: Sequence[int]) -> int:
        """The free slot a sequence with this match should take (see the module docstring)."""
        if not isinstance(match, TieredMatch):
            node, length = self._resume_point(match, prompt_length)
            in_place = sorted(self._holders_of(node).intersection(free_slots)) if length else []
            if in_place:
                return in_place[0]
        return min(free_slots, key=lambda slot: (self._exclusive_tokens(slot), slot))

    def _resume_point(self, match: PrefixMatch, prompt_length: int) -> tuple[CacheNode, int]:
        """Where a prompt with this match resumes: the reusable part of the match, or with
        recurrent state the deepest node within it holding a snapshot (root, 0: nowhere)."""
        length = self.policy.reusable_length(match.length, prompt_length)
        book = self.snapshots
        if book is None:
            return match.node, length
        kept = book.deepest(match.node, length)
        return (kept, kept.end) if kept is not None else (self.tree.root, 0)

    def attach(self, slot: int, arrival: Arrival) -> int:
        """Makes free ``slot``'s KV hold the matched prefix of the arrival's tokens and marks
        the slot running; returns the number of tokens that need no computing."""
        assert slot not in self._running, f"slot {slot} is already running"
        if self.snapshots is not None:
            return self._attach_resuming(slot, arrival)
        tokens, match, count = arrival.tokens, arrival.match, not arrival.resumed
        length = self.policy.reusable_length(match.length, len(tokens))
        if isinstance(match, TieredMatch):
            if self._restore(slot, match, length):
                return self._attached(slot, tokens, length, count)
            # The slot's content went; what the slots still hold is matched afresh.
            match = self.tree.match_prefix(tokens[: len(tokens) - 1])
            length = self.policy.reusable_length(match.length, len(tokens))
        holders = self.holders(match)
        if slot in holders:
            self._save(slot, kept=length)  # its tail beyond the prefix is about to go
            self.kv.trim_kv(slot, length)  # it starts with the prefix: cut it back in place
        else:
            self._save(slot)
            self._forget(slot)
            if length:
                self.kv.copy_kv(min(holders), slot, length)
            else:
                self.kv.trim_kv(slot, 0)
        return self._attached(slot, tokens, length, count)

    def _attach_resuming(self, slot: int, arrival: Arrival) -> int:
        """``attach`` with recurrent state: the slot's stream becomes a holder's, whole, with
        the state of the snapshot it resumes from, trimmed to that snapshot's position."""
        book = self.snapshots
        assert book is not None
        tokens, match = arrival.tokens, arrival.match
        node, length = self._resume_point(match, len(tokens))
        holders = self._holders_of(node) if length else set()
        if slot not in holders:
            self._forget(slot)
            if length:
                source = min(holders)
                self.kv.copy_kv(source, slot, self.kv.kv_tokens(source))
        if length:
            book.runner.restore_state(slot, book.at_node[node])
        self.kv.trim_kv(slot, length)
        reused = self._attached(slot, tokens, length, not arrival.resumed)
        cacheable = self.policy.cacheable_length(arrival.prompt_length, len(tokens))
        book.plan(slot, length, match.length, cacheable)
        return reused

    def _attached(self, slot: int, tokens: Sequence[int], length: int, count: bool) -> int:
        self._set_end(slot, self.tree.insert(tokens[:length]))
        self._running.add(slot)
        self.tree.lock(self._end[slot])
        if count:
            self._count_lookup(len(tokens), length)
        return length

    def _restore(self, slot: int, match: TieredMatch, length: int) -> bool:
        """Makes free ``slot``'s KV the saved state's first ``length`` tokens. False when the
        state could not be read (the slot is untouched) or the runner could not restore it
        (the slot then holds nothing the tree records)."""
        host, kv = self.host, self.kv
        assert host is not None and match.saved is not None and isinstance(kv, SavableKvStore)

        def write(data: bytearray) -> bool | None:
            self._save(slot)  # may move that state out of RAM: ``data`` still holds it
            self._forget(slot)
            if not kv.restore_kv(slot, data):
                kv.trim_kv(slot, 0)
                return None
            kv.trim_kv(slot, length)
            return True

        return host.restore(match.saved, length, write) is not None

    def _save(self, slot: int, kept: int = 0) -> None:
        """Saves free ``slot``'s content to the host tier before all but its first ``kept``
        tokens go, if nothing else would keep them."""
        if self.host is None:
            return
        end = self._end[slot].end
        self._save_path(slot, end, min(self._exclusive_tokens(slot), end - kept))

    def _save_path(self, slot: int, end: int, lost: int) -> None:
        """Saves ``slot``'s first ``end`` tokens (all it holds) when ``lost`` of them would
        otherwise be gone, and that many are worth the copy."""
        kv = self.kv
        assert self.host is not None and isinstance(kv, SavableKvStore)
        if not worth_saving(lost, end):
            return
        self.host.save(self.tree.path_tokens(self._end[slot]), lambda: kv.save_kv(slot))

    # ---- progress and end -------------------------------------------------------------------

    def extend(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        """Records that running ``slot``'s KV starts with ``cacheable_tokens`` (it may hold
        more: see :meth:`cacheable_length`)."""
        assert slot in self._running, f"slot {slot} is not running"
        self._set_end(slot, self.tree.insert(cacheable_tokens))
        book = self.snapshots
        if book is not None:  # the snapshots its prompt has filled go to the nodes ending there
            for position, snapshot in book.reached(slot, len(cacheable_tokens)):
                book.keep(self.tree.insert(cacheable_tokens[:position]), snapshot)

    def release(self, slot: int, cacheable_tokens: Sequence[int]) -> None:
        """The slot's sequence ended: its KV is trimmed to ``cacheable_tokens`` and stays in
        the slot as cache."""
        self.extend(slot, cacheable_tokens)
        self._running.discard(slot)
        self.tree.unlock(self._end[slot])
        if self.snapshots is None:
            self.kv.trim_kv(slot, len(cacheable_tokens))
        else:
            self.snapshots.forget_slot(slot)
            self._settle(slot)
        self._evict_over_budget()

    def _settle(self, slot: int) -> None:
        """Moves free ``slot``'s end up to the deepest node of its path holding a snapshot and
        gives its stream that state (see the module docstring)."""
        book = self.snapshots
        assert book is not None and slot not in self._running
        node = self._end[slot]
        kept = book.deepest(node, node.end)
        if kept is None:
            self._forget(slot)
            self.kv.trim_kv(slot, 0)
            return
        book.runner.restore_state(slot, book.at_node[kept])
        self.kv.trim_kv(slot, kept.end)
        self._set_end(slot, kept)

    def drop(self, slot: int) -> None:
        """Forgets and frees the slot's KV (its content is unknown after a runner failure)."""
        if slot in self._running:
            self._running.discard(slot)
            self.tree.unlock(self._end[slot])
        if self.snapshots is not None:
            self.snapshots.forget_slot(slot)
        self._forget(slot)
        self.kv.trim_kv(slot, 0)

    def keep_state_at(self, slot: int, position: int, computed: int) -> None:
        if self.snapshots is not None and slot in self._running:
            self.snapshots.plan_one(slot, position, computed)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _give_back(self, node: CacheNode) -> None:
        assert node.parent is not None
        if self.host is not None and node.value:
            # Every holder of a leaf ends at it: any one's whole content is the node's path.
            self._save_path(min(node.value), node.end, len(node.key))
        for slot in node.value:
            if self.snapshots is None:
                self.kv.trim_kv(slot, node.start)
            else:  # trimmed once the eviction is over, where a snapshot is
                self._unsettled.add(slot)
            node.parent.value.add(slot)
            self._end[slot] = node.parent
        node.value.clear()
        if self.snapshots is not None:
            self.snapshots.release_node(node)
        self.evictions += 1

    def _evict(self, num_tokens: int) -> int:
        evicted = super()._evict(num_tokens)
        while self._unsettled:
            self._settle(self._unsettled.pop())
        return evicted

    def _save_leaf(self, node: CacheNode) -> None:
        free = node.value - self._running  # a running slot's KV holds more than the path
        if free:
            self._save_path(min(free), node.end, node.end)
