"""The metrics read at scrape time: every model's engine snapshot (queue, slots, KV, engine
counters summed across reloads) and its prefix cache's figures, as Prometheus families built
afresh at each scrape, so a scrape never waits for a step. The names: ``metrics.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slotserve.engine.core.stats import EngineStats, EngineTotals
from slotserve.engine.prefix_cache.stats import PrefixCacheStats
from slotserve.server.metrics import (
    ENGINE_RESTARTS,
    ENGINE_STEP_SECONDS,
    ENGINE_STEPS,
    KV_CACHE_CAPACITY_TOKENS,
    KV_CACHE_USAGE,
    KV_CACHE_USED_TOKENS,
    KV_INTEGRITY_CHECKS,
    KV_INTEGRITY_FAILURES,
    MODEL_LOADS,
    MODEL_STATE,
    MODEL_STATES,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_BUDGET_TOKENS,
    PREFIX_CACHE_BYTES,
    PREFIX_CACHE_DISK_READ_SECONDS,
    PREFIX_CACHE_ENABLED,
    PREFIX_CACHE_EVICTABLE_TOKENS,
    PREFIX_CACHE_EVICTED_TOKENS,
    PREFIX_CACHE_EVICTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_HOST_BUDGET_BYTES,
    PREFIX_CACHE_HOST_RESTORE_SECONDS,
    PREFIX_CACHE_HOST_RESTORES,
    PREFIX_CACHE_HOST_SAVE_SECONDS,
    PREFIX_CACHE_HOST_SAVES,
    PREFIX_CACHE_LOOKUP_HITS,
    PREFIX_CACHE_LOOKUP_MISSES,
    PREFIX_CACHE_NODES,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_STATE_SNAPSHOT_BYTES,
    PREFIX_CACHE_STATE_SNAPSHOTS,
    PREFIX_CACHE_TIER_BYTES,
    PREFIX_CACHE_TIER_HITS,
    PREFIX_CACHE_TOKENS,
    PROMPT_COMPUTE_SECONDS,
    PROMPT_COMPUTED_TOKENS,
    RUNNER_FORWARD_SECONDS,
    SLOT_STATES,
    SLOTS,
    SPEC_ACCEPTED_PER_POS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
)


@dataclass(frozen=True)
class EngineSample:
    """What :class:`EngineCollector` reads at scrape time (built by the server)."""

    model_state: str
    loads: int
    stats: EngineStats | None  # the current engine's snapshot (None while none is loaded)
    totals: EngineTotals  # counters across reloads
    restarts: int = 0  # engines rebuilt after they died


class EngineCollector(Collector):
    """Gauges and engine counters of every model, from the snapshots their engines last
    published."""

    def __init__(self, samples: Callable[[], list[tuple[str, EngineSample]]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        samples = self._samples()
        families: dict[str, Any] = {}

        def family(kind: Any, name: str, documentation: str, *labels: str) -> Any:
            if name not in families:
                families[name] = kind(name, documentation, labels=["model_name", *labels])
            return families[name]

        for model, s in samples:
            self._add(model, s, family)
        yield from families.values()

    def _add(self, model: str, s: EngineSample, family: Callable[..., Any]) -> None:
        stats, t = s.stats or EngineStats(), s.totals
        for name, documentation, value in (
            (NUM_REQUESTS_RUNNING, "Requests prefilling or generating.", stats.num_running),
            (NUM_REQUESTS_WAITING, "Requests queued or preempted.", stats.num_waiting),
            (
                KV_CACHE_USAGE,
                "Fraction of KV capacity held by running requests "
                "(cached prefixes not counted); 1 means full.",
                stats.kv_usage,
            ),
            (KV_CACHE_USED_TOKENS, "KV positions held by running requests.", stats.kv_used_tokens),
            (
                KV_CACHE_CAPACITY_TOKENS,
                "KV positions the runner can hold.",
                stats.kv_capacity_tokens,
            ),
        ):
            family(GaugeMetricFamily, name, documentation).add_metric([model], value)
        counters = [
            (NUM_PREEMPTIONS, "Sequences preempted because KV ran short.", t.preemptions),
            (ENGINE_STEPS, "Engine steps that ran a forward pass.", t.steps),
            (ENGINE_STEP_SECONDS, "Time spent in engine steps.", t.step_seconds),
            (RUNNER_FORWARD_SECONDS, "Time in the runner's forward passes.", t.forward_seconds),
            (KV_INTEGRITY_CHECKS, "Idle-time KV integrity checks run.", t.integrity_checks),
            (KV_INTEGRITY_FAILURES, "KV integrity checks that failed.", t.integrity_failures),
            (MODEL_LOADS, "Successful model loads (the first and every reload).", s.loads),
            (ENGINE_RESTARTS, "Engines restarted after they died.", s.restarts),
        ]
        spec = t.spec_decode
        if spec is not None:  # vLLM's speculative-decoding counters, when configured
            counters += [
                (SPEC_DRAFTS, "Verification chunks (draft runs) scheduled.", spec.num_drafts),
                (SPEC_DRAFT_TOKENS, "Draft tokens proposed.", spec.num_draft_tokens),
                (SPEC_ACCEPTED_TOKENS, "Draft tokens accepted.", spec.num_accepted_tokens),
            ]
            per_position = family(
                CounterMetricFamily,
                SPEC_ACCEPTED_PER_POS,
                "Draft tokens accepted, by position in the draft.",
                "position",
            )
            for position, value in enumerate(spec.accepted_per_position):
                per_position.add_metric([model, str(position)], value)
        for name, documentation, value in counters:
            family(CounterMetricFamily, name, documentation).add_metric([model], value)
        slots = family(GaugeMetricFamily, SLOTS, "Slots by state.", "state")
        for state in SLOT_STATES:
            slots.add_metric([model, state], sum(1 for x in stats.slots if x.state == state))
        model_state = family(
            GaugeMetricFamily, MODEL_STATE, "1 for the model's current state.", "state"
        )
        for state in MODEL_STATES:
            model_state.add_metric([model, state], float(state == s.model_state))


class PrefixCacheCollector(Collector):
    """Exposes every model's :class:`PrefixCacheStats` to a ``prometheus_client`` registry."""

    def __init__(self, stats: Callable[[], list[tuple[str, PrefixCacheStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Any] = {}
        for model, s in self._stats():
            counters = [
                (
                    PREFIX_CACHE_QUERIES,
                    "Prompt tokens looked up in the prefix cache.",
                    s.query_tokens,
                ),
                (
                    PREFIX_CACHE_HITS,
                    "Prompt tokens whose KV the prefix cache supplied.",
                    s.hit_tokens,
                ),
                (PREFIX_CACHE_LOOKUP_HITS, "Admitted sequences that reused cached KV.", s.hits),
                (PREFIX_CACHE_LOOKUP_MISSES, "Admitted sequences that reused nothing.", s.misses),
                (PREFIX_CACHE_EVICTIONS, "Prefix-cache tree nodes evicted.", s.evictions),
                (PREFIX_CACHE_EVICTED_TOKENS, "Tokens evicted from the cache.", s.evicted_tokens),
                (
                    PREFIX_CACHE_HOST_RESTORES,
                    "Admitted sequences whose prefix was restored from host RAM.",
                    s.host_hits,
                ),
                (
                    PREFIX_CACHE_HOST_RESTORE_SECONDS,
                    "Seconds spent restoring saved states into slots.",
                    s.host_restore_seconds,
                ),
                (PREFIX_CACHE_HOST_SAVES, "Slot states saved to host RAM.", s.host_saves),
                (
                    PREFIX_CACHE_HOST_SAVE_SECONDS,
                    "Seconds spent saving slot states to host RAM.",
                    s.host_save_seconds,
                ),
                (
                    PREFIX_CACHE_DISK_READ_SECONDS,
                    "Seconds spent reading saved states back from disk.",
                    s.disk_read_seconds,
                ),
                (
                    PROMPT_COMPUTED_TOKENS,
                    "Prompt tokens computed, not supplied by the prefix cache.",
                    s.computed_tokens,
                ),
                (
                    PROMPT_COMPUTE_SECONDS,
                    "Forward seconds the computed prompt tokens took (a step's time shared "
                    "among its tokens): set against the restore seconds.",
                    s.compute_seconds,
                ),
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
                (
                    PREFIX_CACHE_HOST_BUDGET_BYTES,
                    "Host RAM the saved states may take (0: no host tier).",
                    s.host_budget_bytes,
                ),
                (
                    PREFIX_CACHE_STATE_SNAPSHOTS,
                    "Recurrent-state snapshots kept (models with recurrent layers).",
                    s.snapshots,
                ),
                (
                    PREFIX_CACHE_STATE_SNAPSHOT_BYTES,
                    "Memory the kept recurrent-state snapshots take.",
                    s.snapshots * s.snapshot_bytes,
                ),
            ]
            for kind, rows in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
                for name, documentation, value in rows:
                    if name not in families:
                        families[name] = kind(name, documentation, labels=["model_name"])
                    families[name].add_metric([model], value)
            tiers = {"slots": (s.hit_tokens - s.host_hit_tokens, s.cached_bytes)}
            # Hits restored from disk are host hits whose state was read from a file.
            tiers["host_ram"] = (s.host_hit_tokens - s.disk_hit_tokens, s.host_bytes)
            tiers["disk"] = (s.disk_hit_tokens, s.disk_bytes)
            for name, kind, documentation, index in (
                (
                    PREFIX_CACHE_TIER_HITS,
                    CounterMetricFamily,
                    "Prompt tokens each tier supplied.",
                    0,
                ),
                (PREFIX_CACHE_TIER_BYTES, GaugeMetricFamily, "Bytes each tier holds.", 1),
            ):
                if name not in families:
                    families[name] = kind(name, documentation, labels=["model_name", "tier"])
                for tier, values in tiers.items():
                    families[name].add_metric([model, tier], values[index])
        yield from families.values()
