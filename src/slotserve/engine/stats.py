"""What the engine publishes about itself after every step (read by ``/v1/slots``, ``/metrics``
and the prefix-cache stats): plain values written by the engine thread, read racily by others."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.engine.prefix_cache import PrefixCacheStats


@dataclass(frozen=True)
class SlotSnapshot:
    index: int
    state: str
    request_id: str | None
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int


@dataclass
class EngineStats:
    """Counters since the engine started, and the state after its last step."""

    steps: int = 0
    step_seconds: float = 0.0
    execute_seconds: float = 0.0
    batch_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0
    queue_wait_seconds: float = 0.0
    requests_admitted: int = 0
    preemptions: int = 0
    slots: tuple[SlotSnapshot, ...] = field(default_factory=tuple)
    num_waiting: int = 0  # queued requests, and preempted sequences waiting for KV
    num_running: int = 0  # requests with a sequence prefilling or generating
    kv_used_tokens: int = 0  # KV taken by running sequences (cached prefixes not counted)
    kv_capacity_tokens: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=lambda: PrefixCacheStats(False))
    integrity_checks: int = 0  # run whenever the engine goes idle
    integrity_failures: int = 0
    last_integrity_error: str | None = None

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV capacity running sequences hold (vLLM's kv_cache_usage_perc)."""
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    @property
    def num_busy_slots(self) -> int:
        return sum(1 for slot in self.slots if slot.state != "free")


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

    def plus(self, stats: EngineStats, forward_seconds: float) -> EngineTotals:
        return EngineTotals(
            self.preemptions + stats.preemptions,
            self.steps + stats.steps,
            self.step_seconds + stats.step_seconds,
            self.forward_seconds + forward_seconds,
            self.integrity_checks + stats.integrity_checks,
            self.integrity_failures + stats.integrity_failures,
        )
