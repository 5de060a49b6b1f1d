"""How the ingress's handle picks an engine replica for a request (Ray Serve request routers).

``prefix``: Ray's ``PrefixCacheAffinityRouter`` (from its LLM package): a prefix tree of the
prompt text each replica was sent, kept in one Ray actor every router shares; a request goes
to the replica whose earlier prompts match most of its text (at least ``match_rate_threshold``
of it), else to the replica holding the least text; whenever the replicas' queue lengths
differ by more than ``imbalanced_threshold`` it routes by load alone (power of two choices).
The threshold is always set here: Ray's default changed between versions (10, then none at
all), and with none a hot prefix queues on one replica while the others idle.

``round-robin``: replicas in turn (the benchmark's baseline); ``pow2``: Ray's default.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's router, made safe for any request: one without text (a GET, a body without a
    prompt) and any routing error fall back to load-based choice; a router that raised would
    leave the request waiting forever.

    Ties (several replicas match as well, or a new prefix finds several with the least text)
    go to the replica with the fewest requests this router sent that have not finished: Ray
    breaks them by probed queue lengths, which lag a burst, and sent a burst of new prefixes
    all to one replica, where they then stayed."""

    _in_flight: dict[Any, int]  # replica id → requests this router sent, not finished

    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize_state(**kwargs)
        self._in_flight = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Any:  # ranks of replicas, best first (Ray's own annotation here says otherwise)
        if pending_request is not None and not _prompt_of(pending_request):
            pending_request = None
        try:
            ranks: list[list[RunningReplica]] = await super().choose_replicas(  # type: ignore[assignment]
                candidate_replicas, pending_request
            )
        except Exception:
            logger.exception("prefix routing failed; routing by load")
            return await super().choose_replicas(candidate_replicas, None)
        if pending_request is None or not ranks or len(ranks[0]) < 2:
            return ranks
        tied = sorted(ranks[0], key=lambda r: self._in_flight.get(r.replica_id, 0))
        return [[tied[0]], tied[1:], *ranks[1:]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        if not _prompt_of(pending_request):
            return
        try:
            super().on_request_routed(pending_request, replica_id, result)
        except Exception:
            logger.exception("could not record a routed prompt")

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1


class RoundRobinRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        chosen = ordered[self._turn % len(ordered)]
        self._turn += 1
        return [[chosen]]


def _prompt_of(pending_request: PendingRequest) -> str:
    for arg in pending_request.args:
        prompt = getattr(arg, "prompt", None)
        if isinstance(prompt, str):
            return prompt
    return ""


def router_config(policy: str, imbalanced_threshold: int) -> Any:
    """The deployment's ``request_router_config`` for ``policy`` (None: Ray's default)."""
    from ray.serve.config import RequestRouterConfig

    # Unpacked dicts: Ray's stubs type these pydantic fields as dicts.
    settings: dict[str, Any]
    if policy == "prefix":
        settings = dict(
            request_router_class=f"{__name__}.PrefixAffinityRouter",
            request_router_kwargs={
                "imbalanced_threshold": imbalanced_threshold,
                "match_rate_threshold": 0.1,
                # The tree holds prompt text: bounded, oldest branches go first.
                "do_eviction": True,
                "eviction_threshold_chars": 4_000_000,
                "eviction_target_chars": 3_600_000,
                "eviction_interval_secs": 10,
            },
        )
        return RequestRouterConfig(**settings)
    if policy == "round-robin":
        settings = {"request_router_class": f"{__name__}.RoundRobinRouter"}
        return RequestRouterConfig(**settings)
    return None
