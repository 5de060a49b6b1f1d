"""The prefix cache's figures (:class:`PrefixCacheStats`): hits, tokens, evictions, memory and
the tiers', as ``/v1/prefix_cache``, ``/metrics`` and the bench read them; and which of them are
totals since start that a reload adds up."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _total(default: float) -> Any:
    """A :class:`PrefixCacheStats` field that counts since start: a reload adds the retired
    engine's count to the new one's (``EngineTotals.with_prefix_counters``)."""
    return field(default=default, metadata={"total": True})


@dataclass(frozen=True)
class PrefixCacheStats:
    """A snapshot for ``/v1/prefix_cache_stats`` and metrics; counters are totals since start."""

    enabled: bool
    disabled_reason: str | None = None
    hits: int = _total(0)  # admitted sequences that reused at least one cached token
    misses: int = _total(0)
    query_tokens: int = _total(0)  # prompt tokens looked up
    hit_tokens: int = _total(0)  # prompt tokens whose KV was reused instead of computed
    cached_tokens: int = 0  # distinct tokens in the tree
    evictable_tokens: int = 0  # ... of which no running sequence uses
    cached_bytes: int = 0
    nodes: int = 0
    evictions: int = _total(0)  # tree nodes removed to make room or because their KV was reused
    evicted_tokens: int = _total(0)
    budget_tokens: int = 0
    kv_bytes_per_token: int = 0
    # The host-RAM tier (``host_tier.py``); zero when the runner has none or it is off.
    host_budget_bytes: int = 0
    host_bytes: int = 0
    host_states: int = 0  # saved sequence states
    host_hits: int = _total(0)  # admitted sequences whose cached prefix was restored from host RAM
    host_hit_tokens: int = _total(0)
    host_saves: int = _total(0)
    host_saved_tokens: int = _total(0)
    host_evictions: int = _total(0)
    host_restore_seconds: float = _total(0.0)
    host_save_seconds: float = _total(0.0)
    # The disk tier beneath host RAM (``disk_tier.py``); zero when there is none.
    disk_budget_bytes: int = 0
    disk_bytes: int = 0
    disk_states: int = 0
    disk_hits: int = _total(0)  # ... of the host hits, those whose state was read from disk
    disk_hit_tokens: int = _total(0)
    disk_writes: int = _total(0)
    disk_write_seconds: float = _total(0.0)
    disk_read_seconds: float = _total(0.0)
    disk_bad_files: int = _total(0)  # truncated, damaged or unreadable files ignored
    # Recurrent-state snapshots (``state_snapshots.py``); zero for a model without them.
    snapshot_capacity: int = 0
    snapshots: int = 0  # kept by tree nodes
    snapshot_bytes: int = 0  # one snapshot's
    snapshot_interval: int = 0
    snapshot_saves: int = _total(0)
    snapshot_taken_back: int = _total(0)  # reused for a newer position while their node stayed
    # Prompt tokens computed rather than supplied by the cache, and the forward time they took
    # (a step's time shared among its tokens): what a hit's restore is set against.
    computed_tokens: int = _total(0)
    compute_seconds: float = _total(0.0)

    @property
    def compute_seconds_per_token(self) -> float:
        return self.compute_seconds / self.computed_tokens if self.computed_tokens else 0.0

    def recompute_seconds(self, tokens: int) -> float:
        """What computing ``tokens`` prompt tokens would have taken at the average rate."""
        return tokens * self.compute_seconds_per_token

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def average_hit_tokens(self) -> float:
        return self.hit_tokens / self.hits if self.hits else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "average_hit_tokens": self.average_hit_tokens,
            "cached_tokens": self.cached_tokens,
            "evictable_tokens": self.evictable_tokens,
            "cached_bytes": self.cached_bytes,
            "nodes": self.nodes,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "budget_tokens": self.budget_tokens,
            "budget_bytes": self.budget_tokens * self.kv_bytes_per_token,
            "computed_tokens": self.computed_tokens,
            "compute_seconds": self.compute_seconds,
            "compute_seconds_per_token": self.compute_seconds_per_token,
            "tiers": {
                "slots": {
                    "hit_tokens": self.hit_tokens - self.host_hit_tokens,
                    "bytes": self.cached_bytes,
                    "recompute_seconds_estimate": self.recompute_seconds(
                        self.hit_tokens - self.host_hit_tokens
                    ),
                },
                "host_ram": {  # hits counted here include those read back from disk
                    "hits": self.host_hits,
                    "hit_tokens": self.host_hit_tokens,
                    "bytes": self.host_bytes,
                    "budget_bytes": self.host_budget_bytes,
                    "states": self.host_states,
                    "saves": self.host_saves,
                    "saved_tokens": self.host_saved_tokens,
                    "evictions": self.host_evictions,
                    "restore_seconds": self.host_restore_seconds,
                    "recompute_seconds_estimate": self.recompute_seconds(self.host_hit_tokens),
                    "save_seconds": self.host_save_seconds,
                },
                "state_snapshots": {
                    "capacity": self.snapshot_capacity,
                    "snapshots": self.snapshots,
                    "bytes": self.snapshots * self.snapshot_bytes,
                    "bytes_each": self.snapshot_bytes,
                    "interval_tokens": self.snapshot_interval,
                    "saves": self.snapshot_saves,
                    "taken_back": self.snapshot_taken_back,
                },
                "disk": {
                    "hits": self.disk_hits,
                    "hit_tokens": self.disk_hit_tokens,
                    "bytes": self.disk_bytes,
                    "budget_bytes": self.disk_budget_bytes,
                    "states": self.disk_states,
                    "writes": self.disk_writes,
                    "write_seconds": self.disk_write_seconds,
                    "read_seconds": self.disk_read_seconds,
                    "recompute_seconds_estimate": self.recompute_seconds(self.disk_hit_tokens),
                    "bad_files": self.disk_bad_files,
                },
            },
        }


# The fields that are totals since start.
PREFIX_CACHE_TOTALS = tuple(f.name for f in fields(PrefixCacheStats) if f.metadata.get("total"))
