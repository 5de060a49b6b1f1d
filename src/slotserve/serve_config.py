"""``slotserve serve``'s configuration: the server's own options and its replicas', beside the
models' (``hosting/config.py``) and each engine's (``engine/config.py``); the command's flags
are derived from them, in one group each (:data:`SERVE_GROUPS`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import (
    PER_MODEL,
    LaunchConfig,
    ModelOptions,
    ModelsConfig,
    RunnerConfig,
)
from slotserve.options import (
    add_arguments,
    configure,
    option,
    options,
    parse_bytes,
    repeated_option,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTING_POLICIES = ("prefix", "round-robin", "pow2")
ADMIN_ROUTES = ("auto", "open", "off")  # server/access.py applies them
# Flags vLLM's (and SGLang's) command lines carry that configure nothing here, as what they
# turn on is always on: accepted so that those command lines run, not options. Other servers'
# spellings of our options are the options' aliases (``option(aliases=...)``).
ACCEPTED_FLAGS: dict[str, str] = {
    "--enable-auto-tool-choice": "accepted for vLLM compatibility: tool_choice 'auto' is always on",
    "--enable-chunked-prefill": "accepted for vLLM compatibility: prompts are always "
    "prefilled in chunks (--prefill-chunk)",
    "--enable-lora": "accepted for vLLM compatibility: LoRA adapters are always served "
    "(--lora-modules, POST /v1/load_lora_adapter)",
    "--trust-remote-code": "accepted for vLLM and SGLang compatibility: no code from a "
    "model's folder is ever run (the model families are built in)",
    "--jinja": "accepted for llama-server compatibility: chat templates are always rendered "
    "with Jinja (the model's own, or --chat-template)",
    "--cont-batching": "accepted for llama-server compatibility: batching is always continuous",
    "--metrics": "accepted for llama-server compatibility: GET /metrics always serves "
    "Prometheus metrics",
    "--enable-metrics": "accepted for SGLang compatibility: GET /metrics always serves "
    "Prometheus metrics",
}


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and how it runs its models."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="port to listen on")
    api_key: str | None = option(
        None,
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
        "the probes' and scrapers' (health, readiness, metrics, the SGLang gateway's "
        "read-only info: docs/operations.md#who-may-call-what); prefer the SLOTSERVE_API_KEY "
        "environment variable, which process listings do not show",
    )
    admin_api_key: str | None = option(
        None,
        help="a key apart for the admin routes (reload, load and unload models and LoRA "
        "adapters, flush the cache): required on them, where --api-key then no longer opens "
        "them; prefer the SLOTSERVE_ADMIN_API_KEY environment variable",
    )
    admin_routes: str = option(
        "auto",
        choices=ADMIN_ROUTES,
        help="the admin routes when no key guards them: auto: callers on this machine only (a "
        "loopback peer, no proxy's forwarding header, a loopback Host, no other page's "
        "Origin); open: anyone who reaches the port; off: 403 whatever the keys",
    )
    allowed_hosts: tuple[str, ...] = repeated_option(
        "HOST",
        help="Host names this server answers besides loopback names and addresses (checked on "
        "a loopback bind, or on any bind once given; '*': any); others get a 403, which stops "
        "DNS rebinding",
    )
    allowed_origins: tuple[str, ...] = repeated_option(
        "ORIGIN",
        help="browser origins (scheme://host:port, or '*') whose pages may call the API, "
        "with CORS headers (vLLM's flag; a JSON list is read too); requests from other "
        "pages' origins get a 403 (default none but the server's own)",
    )
    allowed_methods: tuple[str, ...] = repeated_option(
        "METHOD",
        help="with --allowed-origins: the methods CORS allows (default all)",
    )
    allowed_headers: tuple[str, ...] = repeated_option(
        "HEADER",
        help="with --allowed-origins: the request headers CORS allows (default all)",
    )
    allow_credentials: bool = option(
        False, help="with --allowed-origins: let pages send cookies and authorization (CORS)"
    )
    otlp_traces_endpoint: str | None = option(
        None,
        help="export a span per request (queue, prefill and decode times, tokens, cache "
        "hits) over OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces; the "
        "request's W3C traceparent is continued (needs the tracing extra)",
    )
    shutdown_timeout: float = option(
        30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they "
        "are aborted (default 30)",
    )
    log_level: str = option("info", choices=LOG_LEVELS, help="log level")
    max_request_bytes: int | None = option(
        None,
        parse=parse_bytes,
        help="largest request body accepted (64MiB, or bytes); a larger one is a 413 before "
        "any of it is parsed (default: 32 bytes per token of every slot's context of the "
        "largest loaded model, at least 8MiB)",
    )
    engine_process: bool = option(
        True,
        help="run the scheduler and the runner in a process of their own, apart from HTTP, "
        "tokenization and SSE (default on; --no-engine-process: a thread of the server)",
    )


@dataclass(frozen=True)
class ReplicaConfig:
    """Engine replicas on Ray Serve (``replicas/``)."""

    replicas: int = option(
        0,
        help="serve from N engine replicas on Ray Serve behind this one URL (each a slotserve "
        "serve with the other flags; default 0: this process alone)",
    )
    ray_address: str | None = option(
        None,
        help="with --replicas: a running Ray cluster ('auto', or HOST:PORT of its head; "
        "default: a local Ray instance for this process)",
    )
    replica_cpus: float = option(
        1.0, help="with --replicas: CPUs Ray reserves for each replica (fractions allowed)"
    )
    replica_routing: str = option(
        "prefix",
        choices=ROUTING_POLICIES,
        help="with --replicas: prefix (to the replica that was sent the same prompt start), "
        "round-robin, or pow2 (the less loaded of two)",
    )
    routing_imbalance_threshold: int = option(
        0,
        help="with --replica-routing prefix: route by load alone while the replicas' queues "
        "differ by more than this many requests (default: --slots)",
    )


@dataclass(frozen=True)
class ServeConfig:
    models: ModelsConfig
    launch: LaunchConfig
    server: ServerConfig
    replicas: ReplicaConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """From ``serve``'s parsed flags; ``ValueError`` for values no configuration takes."""
        launch = LaunchConfig(
            configure(EngineConfig, args),
            configure(RunnerConfig, args),
            configure(ModelOptions, args),
        )
        return cls(
            configure(ModelsConfig, args),
            launch,
            configure(ServerConfig, args),
            configure(ReplicaConfig, args),
        )


# (title, what it is, its configuration): serve's flags in --help and docs/configuration.md.
SERVE_GROUPS: tuple[tuple[str, str, type[DataclassInstance]], ...] = (
    ("models", "Which models are served.", ModelsConfig),
    (
        "engine (each model)",
        "Scheduling, the prefix cache, speculative decoding and time limits.",
        EngineConfig,
    ),
    ("runner (each model)", "How the model runs: llama.cpp or PyTorch.", RunnerConfig),
    (
        "model (each model)",
        "How requests are rendered, replies parsed, and a dead engine restarted.",
        ModelOptions,
    ),
    ("server", "The HTTP server.", ServerConfig),
    ("replicas", "Engine replicas on Ray Serve.", ReplicaConfig),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for title, about, config in SERVE_GROUPS:
        if config in PER_MODEL:
            about += " POST /models/load takes them too, named without dashes (ctx_size)."
        group = parser.add_argument_group(title, about)
        add_arguments(group, options(config).values())
    accepted = parser.add_argument_group(
        "accepted from other servers", "Flags that change nothing here (docs/configuration.md)."
    )
    for flag, help_text in ACCEPTED_FLAGS.items():
        accepted.add_argument(flag, action="store_true", help=help_text)
