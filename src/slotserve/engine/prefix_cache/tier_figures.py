"""What the host tier counts (:class:`HostTierCounters`), and the host and disk tiers' figures
under the names :class:`~.stats.PrefixCacheStats` gives them (:func:`tier_figures`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.engine.prefix_cache.disk_tier import DiskTier


@dataclass
class HostTierCounters:
    """Totals since start, for the prefix cache's statistics."""

    hits: int = 0  # sequences whose cached prefix was restored from host memory
    hit_tokens: int = 0
    disk_hits: int = 0  # ... of which the state was read from disk
    disk_hit_tokens: int = 0
    saves: int = 0
    saved_tokens: int = 0
    evictions: int = 0
    restore_seconds: float = 0.0
    save_seconds: float = 0.0


def tier_figures(
    counters: HostTierCounters,
    budget_bytes: int,
    ram_bytes: int,
    states: int,
    disk: DiskTier | None,
) -> dict[str, Any]:
    """The host tier's figures (``budget_bytes``, the ``ram_bytes`` its states take there,
    its ``states`` in RAM or on disk) and, with one beneath it, the disk tier's."""
    c = counters
    fields: dict[str, Any] = {
        "host_budget_bytes": budget_bytes,
        "host_bytes": ram_bytes,
        "host_states": states,
        "host_hits": c.hits,
        "host_hit_tokens": c.hit_tokens,
        "host_saves": c.saves,
        "host_saved_tokens": c.saved_tokens,
        "host_evictions": c.evictions,
        "host_restore_seconds": c.restore_seconds,
        "host_save_seconds": c.save_seconds,
    }
    if disk is not None:
        fields |= {
            "disk_budget_bytes": disk.budget_bytes,
            "disk_bytes": disk.bytes,
            "disk_states": len(disk),
            "disk_hits": c.disk_hits,
            "disk_hit_tokens": c.disk_hit_tokens,
            "disk_writes": disk.counters.writes,
            "disk_write_seconds": disk.counters.write_seconds,
            "disk_read_seconds": disk.counters.read_seconds,
            "disk_bad_files": disk.counters.bad_files,
        }
    return fields
