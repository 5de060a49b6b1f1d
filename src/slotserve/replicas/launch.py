"""``slotserve serve --replicas N [--ray-address ADDR]``: N engine replicas on Ray Serve behind
one OpenAI URL.

Ray places the replicas (``--replica-cpus`` each; ``--ray-address`` joins a running cluster,
else a local Ray instance is started for this process and stopped with it), restarts one that
dies, and runs the HTTP proxy; the ingress (``ingress.py``) forwards each request to the
replica the router picks (``routing.py``). Every replica runs ``slotserve serve`` with this
command's other flags (``replica.py``), so the model path must exist on every node.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import cast

from slotserve.options import options
from slotserve.replicas.routing import router_config
from slotserve.serve_config import ReplicaConfig, ServeConfig, ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "slotserve"
# Flags of this command that are the deployment's, not each replica server's, in every
# spelling; each takes one value.
_DEPLOYMENT_FLAGS = {f for opt in options(ReplicaConfig).values() for f in opt.flags} | {
    f for name in ("host", "port") for f in options(ServerConfig)[name].flags
}


def replica_argv(argv: list[str]) -> list[str]:
    """``argv`` (after ``serve``) without the deployment's own flags."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DEPLOYMENT_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def serve_replicas(config: ServeConfig, argv: list[str]) -> int:
    """Starts the deployment and serves until SIGINT or SIGTERM."""
    import ray
    from ray import serve
    from ray.serve.deployment import Deployment

    from slotserve.replicas.ingress import Ingress
    from slotserve.replicas.replica import EngineReplica
    from slotserve.server.access import access_policy
    from slotserve.server.log_context import configure_logging
    from slotserve.server.route_guards import admin_paths

    replicas, server, limits = config.replicas, config.server, config.launch.engine
    configure_logging(server.log_level)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local = replicas.ray_address is None
    # The replicas' servers read SLOTSERVE_* settings too, on whichever node they run (their
    # command line sets --host, --port and --replicas 0 over any of these: replica.py).
    env_vars = {k: v for k, v in os.environ.items() if k.startswith("SLOTSERVE_")}
    ray.init(
        address="local" if local else replicas.ray_address,
        include_dashboard=False,
        runtime_env={"env_vars": env_vars},
    )
    threshold = replicas.routing_imbalance_threshold or limits.num_slots
    # cast: the stubs give serve.deployment(cls) the decorator-factory overload's type.
    engine = cast(Deployment, serve.deployment(EngineReplica)).options(
        name="EngineReplica",
        num_replicas=replicas.replicas,
        ray_actor_options={"num_cpus": replicas.replica_cpus},
        # A replica's server queues what its slots cannot take (and answers 429 past
        # --max-queue); a few more for the ingress's broadcasts (metrics, health).
        max_ongoing_requests=limits.num_slots + limits.max_queue + 4,
        request_router_config=router_config(replicas.replica_routing, threshold),
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=server.shutdown_timeout,
    )
    ingress = cast(Deployment, serve.deployment(Ingress)).options(
        name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    # The replicas listen on loopback and apply the access rules to what the ingress forwards
    # (the client's Host, and X-Forwarded-For for a caller from elsewhere); the Host rule is
    # the ingress's bind's: any name where it listens beyond loopback.
    access = access_policy(server)
    logger.info("%s", access.describe(admin_paths()))
    serve_argv = replica_argv(argv) + ([] if access.checks_host else ["--allowed-hosts", "*"])
    stop = threading.Event()
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(
            ingress.bind(engine.bind(serve_argv)),
            name=APP_NAME,
            route_prefix="/",
            blocking=False,
        )
        # After Ray's start-up, which sets handlers of its own.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        logger.info(
            "serving %d replicas (%s routing) at http://%s:%d",
            replicas.replicas,
            replicas.replica_routing,
            server.host,
            server.port,
        )
        while not stop.wait(1.0):  # wakes for the signal handlers too
            pass
    finally:
        # On a shared cluster only this application goes; a local instance goes whole.
        if local:
            serve.shutdown()  # type: ignore[no-untyped-call]
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
