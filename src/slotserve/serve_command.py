"""``slotserve serve``: its flags and the server's start; how each model
is built from the flags is ``models/launch.py``'s."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from slotserve.models.launch import (
    DTYPES,
    LOAD_FORMATS,
    RUNNERS,
    build_launch,
    launch_factory,
    startup_models,
)
from slotserve.options import env, env_bool, env_float, env_int, parse_bytes, parse_cache_budget
from slotserve.protocol.reasoning import REASONING_PARSERS
from slotserve.protocol.tool_parsers import TOOL_PARSERS
from slotserve.replicas import ROUTING_POLICIES


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=env("MODEL"),
        help="a GGUF file, an HF model folder, or an HF model id in the local cache "
        "(default: the embedded SmolLM2-135M-Instruct GGUF, unless --model or --models-dir "
        "names models)",
    )
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        metavar="PATH[=NAME]",
        help="serve this model too, under NAME (default: its file name); repeat for several. "
        "Each has its own engine, slots and runner, built from the flags below",
    )
    parser.add_argument(
        "--models-dir",
        default=env("MODELS_DIR"),
        help="a folder of models served by name (a GGUF file by its name without .gguf, a "
        "sub-folder by its name); loaded on first use",
    )
    parser.add_argument(
        "--models-autoload",
        action=argparse.BooleanOptionalAction,
        default=env_bool("MODELS_AUTOLOAD", True),
        help="load a --models-dir model when a request names it (default on; "
        "--no-models-autoload: only POST /models/load loads)",
    )
    parser.add_argument(
        "--models-max",
        type=int,
        default=env_int("MODELS_MAX", 4),
        help="models loaded at once; loading one more unloads the least recently used idle "
        "model (default 4; 0: no limit)",
    )
    parser.add_argument(
        "--unload-timeout",
        type=float,
        default=env_float("UNLOAD_TIMEOUT", 30.0),
        help="seconds POST /models/unload lets a model's requests in flight finish before "
        "cutting them off (default 30)",
    )
    parser.add_argument("--host", default=env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=env_int("PORT", 8000))
    parser.add_argument(
        "--slots",
        type=int,
        default=env_int("SLOTS", 8),
        help="sequences decoded together (default 8)",
    )
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=env_int("CTX_SIZE", 0),
        help="llama.cpp: KV cache tokens for all slots together; each slot gets "
        "ctx-size / slots (default: slots × min(trained context, 4096))",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=env_int("MAX_QUEUE", 64),
        help="requests that may wait for a slot before 429 (default 64)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=env_int("MAX_BATCH_TOKENS", 512),
        help="tokens in one forward pass (default 512)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=env_int("PREFILL_CHUNK", 512),
        help="prompt tokens of one sequence per step (default 512)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=env_int("THREADS", 0),
        help="CPU threads for the runner (default: all cores)",
    )
    parser.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=env_bool("FLASH_ATTN", True),
        help="flash attention kernels (default on: faster batched decode on CPU)",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=env_bool("PREFIX_CACHE", True),
        help="share the KV of common prompt prefixes between requests (default on)",
    )
    parser.add_argument(
        "--prefix-cache-budget",
        type=parse_cache_budget,
        default=env("PREFIX_CACHE_BUDGET"),  # argparse converts a string default
        help="most cached tokens kept once no request uses them: a token count (20000) or "
        "KV bytes (512MiB); default: all that free slots can hold",
    )
    parser.add_argument(
        "--prefix-wait-min-tokens",
        type=int,
        default=env_int("PREFIX_WAIT_MIN_TOKENS", 256),
        help="a request sharing at least this many prompt tokens with a prompt still being "
        "prefilled waits for them to be computed and reuses their KV (default 256)",
    )
    parser.add_argument(
        "--speculative-config",
        default=env("SPECULATIVE_CONFIG"),
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(also disable_by_batch_size: no drafts with more sequences in flight, default 2; "
        "min_acceptance_rate: a hard floor, default none: the draft length follows the "
        "runner's measured cost and the request's acceptance); "
        "greedy and seeded outputs are the same as without it (default off)",
    )
    parser.add_argument(
        "--chat-template",
        default=env("CHAT_TEMPLATE"),
        help="Jinja2 chat template file overriding the model's own",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=env("TOOL_CALL_PARSER"),
        choices=TOOL_PARSERS,
        help="format of the model's tool calls (vLLM's names; default: chosen from the chat "
        "template: <tool_call> → hermes, [TOOL_CALLS] → mistral, Llama 3 → llama3_json, "
        "none → generic, a JSON format described to the model in a system message)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=env("REASONING_PARSER"),
        choices=REASONING_PARSERS,
        help="split <think>...</think> into message.reasoning_content (qwen3, deepseek_r1)",
    )
    parser.add_argument(
        "--served-model-name",
        default=env("SERVED_MODEL_NAME"),
        help="model id clients use (default: the GGUF file name)",
    )
    parser.add_argument(
        "--api-key",
        default=env("API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and /admin routes (health, readiness "
        "and metrics stay open); prefer the SLOTSERVE_API_KEY environment variable, which "
        "process listings do not show",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=env_float("REQUEST_TIMEOUT", 600.0),
        help="seconds after which an unfinished request (queue time included) is cancelled "
        "with a 408 (0: no limit; default 600)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=env_float("SHUTDOWN_TIMEOUT", 30.0),
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they "
        "are aborted (default 30)",
    )
    parser.add_argument(
        "--slow-step-warn",
        type=float,
        default=env_float("SLOW_STEP_WARN", 5.0),
        help="log a warning for an engine step slower than this many seconds (default 5)",
    )
    parser.add_argument(
        "--slow-queue-warn",
        type=float,
        default=env_float("SLOW_QUEUE_WARN", 30.0),
        help="log a warning for a request queued longer than this many seconds (default 30)",
    )
    parser.add_argument(
        "--log-level",
        default=env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=env_bool("ENGINE_PROCESS", True),
        help="run the scheduler and the runner in a process of their own, apart from HTTP, "
        "tokenization and SSE (default on; --no-engine-process: a thread of the server)",
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default=env("RUNNER", "auto"),
        help="auto: llama.cpp for a .gguf file, torch for an HF folder or cached model id",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=env("DTYPE", "auto"),
        help="torch: weight and KV type (auto: bfloat16, batch-invariant on CPU)",
    )
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=env("LOAD_FORMAT", "auto"),
        help="torch: dummy builds random weights from the config (benchmarks)",
    )
    parser.add_argument(
        "--device",
        default=env("DEVICE", "auto"),
        help="torch: cpu, cuda or cuda:N (auto: cuda when available)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=env_int("MAX_MODEL_LEN", 0),
        help="torch: tokens one sequence may hold (default: min(trained context, 4096))",
    )
    parser.add_argument(
        "--kv-memory",
        type=parse_bytes,
        default=env("KV_MEMORY"),
        help="torch: memory for the paged KV cache (2GiB; default on CPU: every slot's "
        "max-model-len within a quarter of RAM; on GPU: --gpu-memory-fraction)",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=env_float("GPU_MEMORY_FRACTION", 0.9),
        help="torch on GPU: fraction of device memory weights and KV may use (default 0.9)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=env_int("BLOCK_SIZE", 16),
        help="torch: positions per KV block (default 16)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=env_int("TENSOR_PARALLEL_SIZE", 1),
        help="torch: ranks that each hold a slice of every layer (one process each; NCCL with "
        "a GPU per rank, else gloo); --threads is then per rank (default 1)",
    )


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine replicas on Ray Serve (``replicas/``)."""
    parser.add_argument(
        "--replicas",
        type=int,
        default=env_int("REPLICAS", 0),
        help="serve from N engine replicas on Ray Serve behind this one URL (each a slotserve "
        "serve with the other flags; default 0: this process alone)",
    )
    parser.add_argument(
        "--ray-address",
        default=env("RAY_ADDRESS"),
        help="with --replicas: a running Ray cluster ('auto', or HOST:PORT of its head; "
        "default: a local Ray instance for this process)",
    )
    parser.add_argument(
        "--replica-cpus",
        type=float,
        default=env_float("REPLICA_CPUS", 1.0),
        help="with --replicas: CPUs Ray reserves for each replica (fractions allowed)",
    )
    parser.add_argument(
        "--replica-routing",
        choices=ROUTING_POLICIES,
        default=env("REPLICA_ROUTING", "prefix"),
        help="with --replicas: prefix (to the replica that was sent the same prompt start), "
        "round-robin, or pow2 (the less loaded of two)",
    )
    parser.add_argument(
        "--routing-imbalance-threshold",
        type=int,
        default=env_int("ROUTING_IMBALANCE_THRESHOLD", 0),
        help="with --replica-routing prefix: route by load alone while the replicas' queues "
        "differ by more than this many requests (default: --slots)",
    )


def serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """``argv``: the command line after ``serve`` (each replica's, with --replicas)."""
    if args.replicas:
        if args.replicas < 1:
            raise SystemExit("--replicas must be >= 1")
        try:
            from slotserve.replicas.launch import serve_replicas
        except ImportError as exc:
            raise SystemExit(
                f"--replicas needs Ray Serve ({exc.name} is missing): pip install -e '.[replicas]'"
            ) from exc
        return serve_replicas(args, argv or [])
    import uvicorn

    from slotserve.models.registry import ModelRegistry
    from slotserve.models.source import ModelUnavailableError
    from slotserve.server.app import create_app
    from slotserve.server.lifecycle import GracefulServer
    from slotserve.server.log_context import configure_logging
    from slotserve.server.metrics import ServerMetrics
    from slotserve.server.serving import ServingContext

    configure_logging(args.log_level)
    metrics = ServerMetrics()
    try:
        if args.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        models_dir = Path(args.models_dir) if args.models_dir else None
        if models_dir is not None and not models_dir.is_dir():
            raise ValueError(f"--models-dir {models_dir} is not a folder")
        registry = ModelRegistry(
            launch_factory(args),
            on_outputs=metrics.observe,
            models_dir=models_dir,
            autoload=args.models_autoload,
            models_max=args.models_max,
            unload_timeout_s=args.unload_timeout,
            engine_process=args.engine_process,
            process_setup=functools.partial(configure_logging, args.log_level),
        )
        for model_path, name in startup_models(args):
            registry.add(build_launch(args, model_path, name, at_startup=True))
    except (ModelUnavailableError, ValueError, FileNotFoundError) as exc:
        print(f"slotserve: {exc}", file=sys.stderr)
        return 2
    ctx = ServingContext(registry, metrics, api_key=args.api_key or None)
    uvicorn_config = uvicorn.Config(
        create_app(ctx),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # keep ours: every line names its request
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    GracefulServer(uvicorn_config, registry, args.shutdown_timeout).run()
    return 1 if registry.startup_error is not None else 0
