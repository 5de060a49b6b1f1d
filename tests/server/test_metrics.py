"""Prefix-cache figures as Prometheus metrics (the /metrics endpoint mounts this collector)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from slotserve.engine.prefix_cache.stats import PrefixCacheStats
from slotserve.server import scrape_metrics


def test_prefix_cache_collector_exposes_counters_and_gauges() -> None:
    stats = PrefixCacheStats(
        enabled=True, hits=3, misses=1, query_tokens=400, hit_tokens=300, cached_tokens=128
    )
    registry = CollectorRegistry()
    registry.register(scrape_metrics.PrefixCacheCollector(lambda: [("smol", stats)]))
    text = generate_latest(registry).decode()
    assert 'vllm:prefix_cache_queries_total{model_name="smol"} 400.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="smol"} 300.0' in text
    assert 'slotserve:prefix_cache_lookup_hits_total{model_name="smol"} 3.0' in text
    assert 'slotserve:prefix_cache_tokens{model_name="smol"} 128.0' in text
    assert 'slotserve:prefix_cache_enabled{model_name="smol"} 1.0' in text
    assert "# TYPE slotserve:prefix_cache_evictions_total counter" in text
