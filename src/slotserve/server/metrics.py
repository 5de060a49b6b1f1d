"""Prometheus metrics for ``/metrics``. Every metric name lives in this module.

vLLM's names are used where the meaning matches, so dashboards built for vLLM work unchanged
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` count tokens, as vLLM's do;
``vllm:kv_cache_usage_perc`` is a fraction, 1 = full, as in vLLM); the rest are
``slotserve:`` names. Every series carries a ``model_name`` label.

Two sources feed them:

* per-request events (:meth:`ServerMetrics.observe`, called on the event loop with every
  step's outputs): token counters and the latency histograms;
* snapshots read at scrape time (``scrape_metrics.py``: ``EngineCollector``,
  ``PrefixCacheCollector``): queue and slot gauges, KV usage, engine counters. A scrape never
  waits for a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

from slotserve.engine.outputs import RequestOutput

# ---- vLLM's names ---------------------------------------------------------------------------
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_PREEMPTIONS = "vllm:num_preemptions"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"

# ---- slotserve's own ------------------------------------------------------------------------
MODEL_STATE = "slotserve:model_state"
MODEL_LOADS = "slotserve:model_loads"
ENGINE_RESTARTS = "slotserve:engine_restarts"
SLOTS = "slotserve:slots"
KV_CACHE_USED_TOKENS = "slotserve:kv_cache_used_tokens"
KV_CACHE_CAPACITY_TOKENS = "slotserve:kv_cache_capacity_tokens"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
ENGINE_STEPS = "slotserve:engine_steps"
ENGINE_STEP_SECONDS = "slotserve:engine_step_seconds"
RUNNER_FORWARD_SECONDS = "slotserve:runner_forward_seconds"
KV_INTEGRITY_CHECKS = "slotserve:kv_integrity_checks"
KV_INTEGRITY_FAILURES = "slotserve:kv_integrity_failures"
REQUEST_TIMEOUTS = "slotserve:request_timeouts"
HTTP_ERRORS = "slotserve:http_errors"
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
PREFIX_CACHE_TIER_HITS = "slotserve:prefix_cache_tier_hit_tokens"
PREFIX_CACHE_TIER_BYTES = "slotserve:prefix_cache_tier_bytes"
PREFIX_CACHE_HOST_RESTORES = "slotserve:prefix_cache_host_restores"
PREFIX_CACHE_HOST_RESTORE_SECONDS = "slotserve:prefix_cache_host_restore_seconds"
PREFIX_CACHE_HOST_SAVES = "slotserve:prefix_cache_host_saves"
PREFIX_CACHE_HOST_SAVE_SECONDS = "slotserve:prefix_cache_host_save_seconds"
PREFIX_CACHE_HOST_BUDGET_BYTES = "slotserve:prefix_cache_host_budget_bytes"
PREFIX_CACHE_DISK_READ_SECONDS = "slotserve:prefix_cache_disk_read_seconds"
PROMPT_COMPUTED_TOKENS = "slotserve:prompt_computed_tokens"
PROMPT_COMPUTE_SECONDS = "slotserve:prompt_compute_seconds"
PREFIX_CACHE_STATE_SNAPSHOTS = "slotserve:prefix_cache_state_snapshots"
PREFIX_CACHE_STATE_SNAPSHOT_BYTES = "slotserve:prefix_cache_state_snapshot_bytes"

MODEL_STATES = ("loading", "ready", "unhealthy", "failed", "draining", "stopped")
SLOT_STATES = ("free", "prefilling", "generating", "draining", "preempted")

# vLLM's bucket edges, so its dashboards' quantile panels line up (TTFT and inter-token
# latency share the edges from 0.75 s to 80 s).
_SECONDS_TO_80 = (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TTFT_TO_HALF_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
_TTFT_BUCKETS = (*_TTFT_TO_HALF_S, *_SECONDS_TO_80, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, *_SECONDS_TO_80)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass
class _RequestTimes:
    arrival: float
    last_token: float | None = None
    queued_observed: bool = False


class ServerMetrics:
    """The registry behind ``/metrics`` and the per-request observations that feed it; every
    series is labelled with the model it is about."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter(PROMPT_TOKENS, "Prompt tokens processed.")
        self.generation_tokens = counter(GENERATION_TOKENS, "Tokens generated.")
        self.timeouts = counter(REQUEST_TIMEOUTS, "Requests ended at the server's time limit.")
        self._success = Counter(
            REQUEST_SUCCESS,
            "Finished requests, by finish reason (stop, length, abort, error).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._http_errors = Counter(
            HTTP_ERRORS,
            "Error responses, by HTTP status and OpenAI error type.",
            [*labels, "status", "type"],
            registry=self.registry,
        )
        self.ttft = histogram(
            TIME_TO_FIRST_TOKEN, "Time from arrival to the first generated token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            INTER_TOKEN_LATENCY, "Time between a request's successive token outputs.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            E2E_REQUEST_LATENCY,
            "Time from arrival to the end of the request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            REQUEST_QUEUE_TIME, "Time a request waited for a slot.", _REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            REQUEST_PROMPT_TOKENS, "Prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            REQUEST_GENERATION_TOKENS, "Generated tokens per finished request.", _TOKEN_BUCKETS
        )
        # By (model, request id): two models' engines may hold the same request id.
        self._live: dict[tuple[str, str], _RequestTimes] = {}

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def count_error(self, status: int, error_type: str, model_name: str) -> None:
        self._http_errors.labels(model_name, str(status), error_type).inc()

    def observe(self, model: str, outputs: list[RequestOutput]) -> None:
        """Event loop: one step's outputs of ``model``'s engine (``AsyncEngine.on_outputs``)."""
        for out in outputs:
            key = (model, out.request_id)
            times = self._live.get(key)
            if times is None:
                times = self._live[key] = _RequestTimes(out.arrival_time)
            if out.queue_seconds is not None and not times.queued_observed:
                times.queued_observed = True
                self.queue_time.labels(model).observe(out.queue_seconds)
            new_tokens = sum(len(d.token_ids) for d in out.deltas)
            if new_tokens:
                if times.last_token is None:
                    self.ttft.labels(model).observe(out.time - times.arrival)
                    self.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
                else:
                    self.itl.labels(model).observe(out.time - times.last_token)
                times.last_token = out.time
                self.generation_tokens.labels(model).inc(new_tokens)
            if out.finished:
                del self._live[key]
                self._finished(model, out, times)

    def _finished(self, model: str, out: RequestOutput, times: _RequestTimes) -> None:
        self.e2e.labels(model).observe(out.time - times.arrival)
        self.request_prompt_tokens.labels(model).observe(out.num_prompt_tokens)
        self.request_generation_tokens.labels(model).observe(out.num_output_tokens)
        if out.timed_out:
            self.timeouts.labels(model).inc()
        reasons = [d.finish_reason for d in out.deltas if d.finish_reason is not None]
        reason = "error" if out.error is not None else (reasons[0] if reasons else "abort")
        self._success.labels(model, reason).inc()
