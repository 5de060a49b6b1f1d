"""Prometheus metric families built from the engine's published snapshots (SPEC S3).

Every metric name lives in this module. vLLM's names are used where the meaning matches
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` count tokens, as vLLM's do); the
rest are ``slotserve:`` names. Collection reads the snapshot the engine thread last published,
so a scrape never waits for a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slotserve.engine.prefix_cache import PrefixCacheStats

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
PREFIX_CACHE_LOOKUP_HITS = "slotserve:prefix_cache_lookup_hits"
PREFIX_CACHE_LOOKUP_MISSES = "slotserve:prefix_cache_lookup_misses"
PREFIX_CACHE_EVICTIONS = "slotserve:prefix_cache_evictions"
PREFIX_CACHE_EVICTED_TOKENS = "slotserve:prefix_cache_evicted_tokens"
PREFIX_CACHE_ENABLED = "slotserve:prefix_cache_enabled"
PREFIX_CACHE_TOKENS = "slotserve:prefix_cache_tokens"
PREFIX_CACHE_EVICTABLE_TOKENS = "slotserve:prefix_cache_evictable_tokens"
PREFIX_CACHE_BYTES = "slotserve:prefix_cache_bytes"
PREFIX_CACHE_NODES = "slotserve:prefix_cache_nodes"
PREFIX_CACHE_BUDGET_TOKENS = "slotserve:prefix_cache_budget_tokens"


class PrefixCacheCollector(Collector):
    """Exposes :class:`PrefixCacheStats` to a ``prometheus_client`` registry."""

    def __init__(self, stats: Callable[[], PrefixCacheStats], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        counters = [
            (PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", s.query_tokens),
            (PREFIX_CACHE_HITS, "Prompt tokens whose KV the prefix cache supplied.", s.hit_tokens),
            (PREFIX_CACHE_LOOKUP_HITS, "Admitted sequences that reused cached KV.", s.hits),
            (PREFIX_CACHE_LOOKUP_MISSES, "Admitted sequences that reused nothing.", s.misses),
            (PREFIX_CACHE_EVICTIONS, "Prefix-cache tree nodes evicted.", s.evictions),
            (PREFIX_CACHE_EVICTED_TOKENS, "Tokens evicted from the cache.", s.evicted_tokens),
        ]
        gauges = [
            (PREFIX_CACHE_ENABLED, "1 when the prefix cache is on.", int(s.enabled)),
            (PREFIX_CACHE_TOKENS, "Distinct tokens held in the prefix cache.", s.cached_tokens),
            (
                PREFIX_CACHE_EVICTABLE_TOKENS,
                "Cached tokens no running request uses (evictable).",
                s.evictable_tokens,
            ),
            (PREFIX_CACHE_BYTES, "KV bytes of the cached tokens.", s.cached_bytes),
            (PREFIX_CACHE_NODES, "Nodes of the prefix-cache radix tree.", s.nodes),
            (PREFIX_CACHE_BUDGET_TOKENS, "Evictable tokens kept at most.", s.budget_tokens),
        ]
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric(self._labels, value)
            yield counter
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(self._labels, value)
            yield gauge
