"""Engine configuration: one frozen, validated dataclass handed down explicitly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "min_acceptance_rate",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's keys, plus ``min_acceptance_rate``: a sequence whose drafts are accepted less
    often than this (after ``probe_tokens`` drafted tokens) stops drafting for good; None
    leaves the decision to the cost model alone. ``num_speculative_tokens`` is the most drafts
    a step verifies. ``disable_by_batch_size`` (vLLM's name): no drafts while more sequences
    than this are in flight (running or waiting)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 2
    min_acceptance_rate: float | None = None
    probe_tokens: int = 16

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative method {self.method!r} is not supported (ngram)")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if self.min_acceptance_rate is not None and not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError("min_acceptance_rate must be in [0, 1]")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses ``--speculative-config`` (a JSON object); ``ValueError`` says what is wrong."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown} (known: {sorted(_KEYS)})"
            )
        if "method" not in raw:
            raise ValueError('--speculative-config needs "method" (only "ngram" is supported)')
        kinds: dict[str, type | tuple[type, ...]] = {
            "method": str,
            "min_acceptance_rate": (int, float),
        }
        for key, value in raw.items():
            kind = kinds.get(key, int)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"--speculative-config: {key} has the wrong type")
        raw.setdefault("prompt_lookup_max", max(raw.get("prompt_lookup_min", 2), 4))
        return cls(**raw)


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

    ``speculative``: speculative decoding (``decoding/speculative.py``); None: off.
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
