"""Engine configuration: one frozen, validated dataclass handed down explicitly. Its fields are
also ``slotserve serve``'s scheduling options (``slotserve.options``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slotserve.options import CacheBudget, option, parse_bytes, parse_cache_budget

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


def _seconds_or_no_limit(text: str) -> float | None:
    return float(text) or None


SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits.

    ``max_batch_tokens`` bounds the tokens of one forward pass (decode tokens plus prefill
    chunks); ``prefill_chunk`` bounds one sequence's share of it. ``max_queue`` bounds requests
    waiting for a slot; one more is refused at once. ``max_tokens_default`` bounds the output
    of a request that sets no ``max_tokens`` (0: its context's room).

    The prefix cache (``prefix_cache``) keeps at most ``prefix_cache_budget`` of unused tokens
    (a token count, or bytes of their KV; None: all the free slots can hold). A waiting request
    whose prompt shares at least ``prefix_wait_min_tokens`` tokens with a prompt still being
    prefilled waits until those are computed, then reuses them. ``schedule_policy`` orders the
    waiting requests for free slots (scheduler invariant 4).

    ``request_timeout_s`` ends a request that has not finished that long after it arrived
    (queued time included; None: no limit). A step slower than ``slow_step_warn_s`` and a
    queue wait longer than ``slow_queue_warn_s`` are logged as warnings.

    ``encoder_share``: the most of the engine's time image encodes take while sequences decode
    (``engine/images.py``).

    ``speculative``: speculative decoding (``decoding/speculative.py``); None: off.
    """

    # aliases: vLLM's, SGLang's and llama-server's spellings of the same setting
    # (docs/configuration.md).
    num_slots: int = option(
        8,
        flag="--slots",
        ge=1,
        aliases=("--max-num-seqs", "--max-running-requests", "--parallel", "-np"),
        help="sequences decoded together (default 8)",
    )
    max_batch_tokens: int = option(
        512,
        ge=1,
        aliases=("--max-num-batched-tokens", "--batch-size", "-b"),
        help="tokens in one forward pass (default 512)",
    )
    prefill_chunk: int = option(
        512,
        ge=1,
        aliases=("--chunked-prefill-size",),
        help="prompt tokens of one sequence per step (default 512)",
    )
    max_queue: int = option(
        64,
        ge=0,
        aliases=("--max-queued-requests",),
        help="requests that may wait for a slot before 429 (default 64)",
    )
    max_tokens_default: int = option(
        1024,
        ge=0,
        help="tokens a request that sets no max_tokens (max_completion_tokens, "
        "max_output_tokens) generates at most, fewer where its context has less room; a "
        "request's own max_tokens is never changed (0: until the context is full, as vLLM; "
        "default 1024)",
    )
    prefix_cache: bool = option(
        True,
        aliases=("--enable-prefix-caching",),
        help="share the KV of common prompt prefixes between requests (default on)",
    )
    # option() is dataclasses.field() with the option's declaration: no shared default.
    prefix_cache_budget: CacheBudget | None = option(  # noqa: RUF009
        None,
        parse=parse_cache_budget,
        wire=int | str,
        help="most cached tokens kept once no request uses them: a token count (20000) or "
        "KV bytes (512MiB); default: all that free slots can hold",
    )
    prefix_cache_ram: int | None = option(
        None,
        parse=parse_bytes,
        wire=int | str,
        help="host RAM for cached prefixes about to leave the runner's KV (a free llama.cpp "
        "slot reused, a leaf evicted from the PyTorch pool), restored on a later hit instead of "
        "computed again: bytes (8GiB; 0: off); default: a quarter of the free RAM at start, at "
        "most 8 GiB",
    )
    prefix_cache_dir: str | None = option(
        None,
        help="directory for a disk tier beneath --prefix-cache-ram: states leaving RAM, and "
        "every cached prefix at shutdown, are kept there and reused by a later start of the "
        "same model (servers may share it; default off)",
    )
    prefix_cache_dir_size: int | None = option(
        None,
        parse=parse_bytes,
        wire=int | str,
        help="most bytes the disk tier keeps (64GiB); default: a quarter of the free space of "
        "its filesystem at start, at most 64 GiB",
    )
    prefix_cache_snapshot_interval: int = option(
        1024,
        ge=1,
        help="models with recurrent layers (Gated DeltaNet): besides each prompt's end and "
        "where it leaves a cached prefix, keep the recurrent state every this many prompt "
        "tokens (rounded down to the chunk grain, 64), so prompts sharing a prefix resume "
        "from there (default 1024)",
    )
    schedule_policy: str = option(
        "fcfs",
        choices=SCHEDULE_POLICIES,
        aliases=("--scheduling-policy",),
        help="which waiting request takes a free slot: fcfs, in arrival order; lpm, SGLang's "
        "longest prefix match: the longest cached prompt prefix first (a conversation's next "
        "turn before cold prompts), a request overtaken at most --slots times; priority, "
        "vLLM's: the request's priority field first (lower first), arrival order among equals, "
        "and when KV runs short the lowest priority is preempted first (default fcfs)",
    )
    prefix_wait_min_tokens: int = option(
        256,
        ge=1,
        help="a request sharing at least this many prompt tokens with a prompt still being "
        "prefilled waits for them to be computed and reuses their KV (default 256)",
    )
    encoder_share: float = option(
        0.1,
        ge=0,
        help="vision models: the most of the engine's time that encoding images (a piece of "
        "the vision tower at a time, between steps) may take while sequences decode; smaller "
        "keeps streams' time per token lower, larger serves new images sooner (default 0.1)",
    )
    request_timeout_s: float | None = option(
        600.0,
        flag="--request-timeout",
        parse=_seconds_or_no_limit,
        ge=0,
        help="seconds after which an unfinished request (queue time included) is cancelled "
        "with a 408 (0: no limit; default 600)",
    )
    slow_step_warn_s: float = option(
        5.0,
        flag="--slow-step-warn",
        help="log a warning for an engine step slower than this many seconds (default 5)",
    )
    slow_queue_warn_s: float = option(
        30.0,
        flag="--slow-queue-warn",
        help="log a warning for a request queued longer than this many seconds (default 30)",
    )
    speculative: SpeculativeConfig | None = option(  # noqa: RUF009
        None,
        flag="--speculative-config",
        parse=SpeculativeConfig.from_json,
        wire=dict[str, Any] | str,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(also disable_by_batch_size: no drafts with more sequences in flight, default 2; "
        "min_acceptance_rate: a hard floor, default none: the draft length follows the "
        "runner's measured cost and the request's acceptance); "
        "greedy and seeded outputs are the same as without it (default off)",
    )

    @property
    def prefix_cache_budget_tokens(self) -> int | None:
        return self.prefix_cache_budget.tokens if self.prefix_cache_budget else None

    @property
    def prefix_cache_budget_bytes(self) -> int | None:
        return self.prefix_cache_budget.bytes if self.prefix_cache_budget else None

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
        if self.max_tokens_default < 0:
            raise ValueError("max_tokens_default must be >= 0")
        for name in ("prefix_cache_budget_tokens", "prefix_cache_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("prefix_cache_ram", "prefix_cache_dir_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.prefix_cache_dir is not None and (
            not self.prefix_cache_dir or "\0" in self.prefix_cache_dir
        ):
            raise ValueError("prefix_cache_dir must be a folder's path")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        if not 0 < self.encoder_share < 1:
            raise ValueError("encoder_share must be > 0 and < 1")
        if self.prefix_wait_min_tokens < 1:
            raise ValueError("prefix_wait_min_tokens must be >= 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.slow_step_warn_s <= 0 or self.slow_queue_warn_s <= 0:
            raise ValueError("warning thresholds must be > 0")
