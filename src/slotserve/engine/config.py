"""Engine configuration: one frozen, validated dataclass handed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits.

    ``max_batch_tokens`` bounds the tokens of one forward pass (decode tokens plus prefill
    chunks); ``prefill_chunk`` bounds one sequence's share of it. ``max_queue`` bounds requests
    waiting for a slot; one more is refused at once.

    The prefix cache (``prefix_cache``) keeps at most ``prefix_cache_budget_tokens`` unused
    tokens and ``prefix_cache_budget_bytes`` of their KV (None: all the free slots can hold).
    A waiting request whose prompt shares at least ``prefix_wait_min_tokens`` tokens with a
    prompt still being prefilled waits until those are computed, then reuses them.

    ``request_timeout_s`` ends a request that has not finished that long after it arrived
    (queued time included; None: no limit). A step slower than ``slow_step_warn_s`` and a
    queue wait longer than ``slow_queue_warn_s`` are logged as warnings.

    ``speculative``: speculative decoding (``speculative.py``); None: off.
    """

    num_slots: int = 8
    max_batch_tokens: int = 512
    prefill_chunk: int = 512
    max_queue: int = 64
    prefix_cache: bool = True
    prefix_cache_budget_tokens: int | None = None
    prefix_cache_budget_bytes: int | None = None
    prefix_wait_min_tokens: int = 256
    request_timeout_s: float | None = None
    slow_step_warn_s: float = 5.0
    slow_queue_warn_s: float = 30.0
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.max_batch_tokens <= self.num_slots:
            # Every generating slot gets one decode token per step; prefill needs room too.
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must exceed num_slots "
                f"({self.num_slots})"
            )
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        for name in ("prefix_cache_budget_tokens", "prefix_cache_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.prefix_wait_min_tokens < 1:
            raise ValueError("prefix_wait_min_tokens must be >= 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.slow_step_warn_s <= 0 or self.slow_queue_warn_s <= 0:
            raise ValueError("warning thresholds must be > 0")
