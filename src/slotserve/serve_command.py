"""``slotserve serve``: the server's start from its configuration (``serve_config.py``,
whose options are its flags); how each model is built is ``hosting/launch.py``'s."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

from slotserve.hosting.launch import build_launch, launch_factory, startup_models
from slotserve.serve_config import ServeConfig

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """``args``: ``serve``'s parsed flags; ``argv``: the command line after ``serve`` (each
    replica's, with --replicas)."""
    try:
        config = ServeConfig.from_args(args)
    except ValueError as exc:
        print(f"slotserve: {exc}", file=sys.stderr)
        return 2
    if config.replicas.replicas:
        if config.replicas.replicas < 1:
            raise SystemExit("--replicas must be >= 1")
        try:
            from slotserve.replicas.launch import serve_replicas
        except ImportError as exc:
            raise SystemExit(
                f"--replicas needs Ray Serve ({exc.name} is missing): pip install -e '.[replicas]'"
            ) from exc
        return serve_replicas(config, argv or [])
    import uvicorn

    from slotserve.hosting.registry import ModelRegistry
    from slotserve.hosting.source import ModelUnavailableError
    from slotserve.server.access import access_policy
    from slotserve.server.app import create_app
    from slotserve.server.connections import KEEP_ALIVE_S, HttpProtocol, raise_open_file_limit
    from slotserve.server.lifecycle import GracefulServer
    from slotserve.server.log_context import configure_logging
    from slotserve.server.metrics import ServerMetrics
    from slotserve.server.route_guards import admin_paths
    from slotserve.server.serving import CorsRules, ServingContext
    from slotserve.server.tracing import observe_both, request_tracer

    server, models = config.server, config.models
    configure_logging(server.log_level)
    metrics = ServerMetrics()
    try:
        if server.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        access = access_policy(server)
        models_dir = Path(models.models_dir) if models.models_dir else None
        if models_dir is not None and not models_dir.is_dir():
            raise ValueError(f"--models-dir {models_dir} is not a folder")
        tracer = (
            request_tracer(server.otlp_traces_endpoint) if server.otlp_traces_endpoint else None
        )
        registry = ModelRegistry(
            launch_factory(config.launch),
            on_outputs=metrics.observe if tracer is None else observe_both(metrics, tracer),
            models_dir=models_dir,
            autoload=models.models_autoload,
            models_max=models.models_max,
            unload_timeout_s=models.unload_timeout,
            engine_process=server.engine_process,
            process_setup=functools.partial(configure_logging, server.log_level),
        )
        for model_path, name in startup_models(models):
            registry.add(build_launch(config.launch, model_path, name, at_startup=True))
    except (ModelUnavailableError, ValueError, FileNotFoundError) as exc:
        print(f"slotserve: {exc}", file=sys.stderr)
        return 2
    cors = CorsRules(server.allowed_methods, server.allowed_headers, server.allow_credentials)
    ctx = ServingContext(
        registry,
        metrics,
        access=access,
        cors=cors if access.allowed_origins else None,
        max_request_bytes=server.max_request_bytes,
        tracer=tracer,
    )
    logger.info("%s", access.describe(admin_paths()))
    cap = config.launch.engine.max_tokens_default
    logger.info(
        "a request that sets no max_tokens generates %s (--max-tokens-default)",
        f"at most {cap} tokens" if cap else "until its context is full",
    )
    raise_open_file_limit()  # one descriptor per client connection
    uvicorn_config = uvicorn.Config(
        create_app(ctx),
        host=server.host,
        port=server.port,
        http=HttpProtocol,  # closes connections that stay silent, not only idle keep-alive ones
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level=server.log_level,
        log_config=None,  # keep ours: every line names its request
        # The peer is who connected: a forwarding header is the access rules' to read, never
        # taken as the caller's address (uvicorn trusts one from 127.0.0.1 by default).
        proxy_headers=False,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    GracefulServer(uvicorn_config, registry, server.shutdown_timeout).run()
    return 1 if registry.startup_error is not None else 0
