"""What the engine publishes about itself (read by ``/v1/slots``, ``/metrics``, the prefix-cache
stats and the 429 decision): counters the core keeps, and the :class:`EngineStats` snapshot it
builds after every step. Readers on other threads only ever see whole snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from slotserve.engine.core.slots import SlotSnapshot
from slotserve.engine.decoding.speculative import SpecCounters
from slotserve.engine.prefix_cache.stats import PREFIX_CACHE_TOTALS, PrefixCacheStats


@dataclass
class EngineCounters:
    """Totals since the engine started; written by the engine thread only."""

    steps: int = 0
    step_seconds: float = 0.0
    execute_seconds: float = 0.0
    prompt_computed_tokens: int = 0  # prompt tokens run through the model, not cache hits
    prompt_compute_seconds: float = 0.0  # their share of the forward time (by token count)
    generated_tokens: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0
    integrity_checks: int = 0  # run whenever the engine goes idle
    integrity_failures: int = 0
    last_integrity_error: str | None = None


@dataclass
class EngineStats(EngineCounters):
    """The counters and the state after one step. A new one is built for every publication and
    never changed after, so any thread may read one whole."""

    preemptions: int = 0
    slots: tuple[SlotSnapshot, ...] = ()
    num_waiting: int = 0  # queued requests, and preempted sequences waiting for KV
    num_running: int = 0  # requests with a sequence prefilling or generating
    num_free_slots: int = 0
    kv_used_tokens: int = 0  # KV taken by running sequences (cached prefixes not counted)
    kv_capacity_tokens: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=lambda: PrefixCacheStats(False))
    unhealthy: str | None = None  # why the engine was poisoned; None while healthy
    spec_decode: SpecCounters | None = None  # speculative decoding's counters; None when off

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV capacity running sequences hold (vLLM's kv_cache_usage_perc)."""
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


@dataclass(frozen=True)
class EngineTotals:
    """Monotonic counters summed over engines: the server adds each engine it replaces (a
    reload) to the current one's, so Prometheus counters never go backwards."""

    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    integrity_checks: int = 0
    integrity_failures: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=lambda: PrefixCacheStats(False))
    spec_decode: SpecCounters | None = None

    def plus(self, stats: EngineStats, forward_seconds: float) -> EngineTotals:
        return EngineTotals(
            self.preemptions + stats.preemptions,
            self.steps + stats.steps,
            self.step_seconds + stats.step_seconds,
            self.forward_seconds + forward_seconds,
            self.integrity_checks + stats.integrity_checks,
            self.integrity_failures + stats.integrity_failures,
            self.with_prefix_counters(stats.prefix_cache),
            stats.spec_decode.plus(self.spec_decode) if stats.spec_decode else self.spec_decode,
        )

    def with_prefix_counters(self, current: PrefixCacheStats) -> PrefixCacheStats:
        """``current`` (the live engine's cache) with the retired engines' counters added."""
        retired = self.prefix_cache
        return replace(
            current,
            **{
                name: getattr(retired, name) + getattr(current, name)
                for name in PREFIX_CACHE_TOTALS
            },
        )
