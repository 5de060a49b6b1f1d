"""Command line: ``slotserve serve [MODEL_PATH]``, ``slotserve reload``, ``slotserve bench``,
``slotserve bench sweep`` (SPEC C1, S5, B1, B2).

Every flag has a ``SLOTSERVE_*`` environment equivalent (``--ctx-size`` ↔
``SLOTSERVE_CTX_SIZE``); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from slotserve import __version__


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SLOTSERVE_{name}", default)


def _env_int(name: str, default: int) -> int:
    value = _env(name)
    return default if value is None else int(value)


def _env_float(name: str, default: float) -> float:
    value = _env(name)
    return default if value is None else float(value)


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_cache_budget(text: str) -> tuple[int | None, int | None]:
    """``"20000"`` → (20000 tokens, None); ``"512MiB"`` → (None, 536870912 bytes)."""
    value = text.strip().lower().replace(" ", "")
    if value.isdigit():
        return int(value), None
    number = value.rstrip("bgikm")
    unit = value[len(number) :]
    try:
        if unit not in _BYTE_UNITS:
            raise ValueError(unit)
        return None, int(float(number) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid budget {text!r}: a token count (20000) or bytes with a unit (512MiB, 2GB)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"slotserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a GGUF model over the OpenAI API")
    serve.add_argument(
        "model",
        nargs="?",
        default=_env("MODEL"),
        help="GGUF file (default: the embedded SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=_env_int("PORT", 8000))
    serve.add_argument(
        "--slots",
        type=int,
        default=_env_int("SLOTS", 8),
        help="sequences decoded together (default 8)",
    )
    serve.add_argument(
        "--ctx-size",
        type=int,
        default=_env_int("CTX_SIZE", 0),
        help="KV cache tokens for all slots together; each slot gets "
        "ctx-size / slots (default: slots × min(trained context, 4096))",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=_env_int("MAX_QUEUE", 64),
        help="requests that may wait for a slot before 429 (default 64)",
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        default=_env_int("MAX_BATCH_TOKENS", 512),
        help="tokens in one forward pass (default 512)",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=_env_int("PREFILL_CHUNK", 512),
        help="prompt tokens of one sequence per step (default 512)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=_env_int("THREADS", 0),
        help="CPU threads for llama.cpp (default: all cores)",
    )
    serve.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("FLASH_ATTN", True),
        help="flash attention kernels (default on: faster batched decode on CPU)",
    )
    serve.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("PREFIX_CACHE", True),
        help="share the KV of common prompt prefixes between requests (default on)",
    )
    serve.add_argument(
        "--prefix-cache-budget",
        type=parse_cache_budget,
        default=_env("PREFIX_CACHE_BUDGET"),  # argparse converts a string default
        help="most cached tokens kept once no request uses them: a token count (20000) or "
        "KV bytes (512MiB); default: all that free slots can hold",
    )
    serve.add_argument(
        "--prefix-wait-min-tokens",
        type=int,
        default=_env_int("PREFIX_WAIT_MIN_TOKENS", 256),
        help="a request sharing at least this many prompt tokens with a prompt still being "
        "prefilled waits for them to be computed and reuses their KV (default 256)",
    )
    serve.add_argument(
        "--chat-template",
        default=_env("CHAT_TEMPLATE"),
        help="Jinja2 chat template file overriding the model's own",
    )
    serve.add_argument(
        "--served-model-name",
        default=_env("SERVED_MODEL_NAME"),
        help="model id clients use (default: the GGUF file name)",
    )
    serve.add_argument(
        "--api-key",
        default=_env("API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and /admin routes (health, readiness "
        "and metrics stay open); prefer the SLOTSERVE_API_KEY environment variable, which "
        "process listings do not show",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=_env_float("REQUEST_TIMEOUT", 600.0),
        help="seconds after which an unfinished request (queue time included) is cancelled "
        "with a 408 (0: no limit; default 600)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_env_float("SHUTDOWN_TIMEOUT", 30.0),
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they "
        "are aborted (default 30)",
    )
    serve.add_argument(
        "--slow-step-warn",
        type=float,
        default=_env_float("SLOW_STEP_WARN", 5.0),
        help="log a warning for an engine step slower than this many seconds (default 5)",
    )
    serve.add_argument(
        "--slow-queue-warn",
        type=float,
        default=_env_float("SLOW_QUEUE_WARN", 30.0),
        help="log a warning for a request queued longer than this many seconds (default 30)",
    )
    serve.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    reload = commands.add_parser(
        "reload", help="ask a running server to reload its model (recovers an unhealthy one)"
    )
    reload.add_argument("--url", default=_env("URL", "http://127.0.0.1:8000"))
    reload.add_argument("--api-key", default=_env("API_KEY"))
    bench = commands.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server ('bench sweep': slot sweep + peers; "
        "'bench prefix-cache': shared system prompt, cache on vs off)",
    )
    from slotserve.bench.cli import add_bench_arguments

    add_bench_arguments(bench)
    return parser


def _bench_subcommand_parser(
    name: str, description: str | None, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"slotserve bench {name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def build_sweep_parser() -> argparse.ArgumentParser:
    from slotserve.bench import sweep

    return _bench_subcommand_parser("sweep", sweep.__doc__, sweep.add_sweep_arguments)


def build_prefix_ab_parser() -> argparse.ArgumentParser:
    from slotserve.bench import prefix_ab

    return _bench_subcommand_parser(
        "prefix-cache", prefix_ab.__doc__, prefix_ab.add_prefix_ab_arguments
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from slotserve.engine.config import EngineConfig
    from slotserve.model_source import ModelUnavailableError, resolve_model_path
    from slotserve.runners.llama_cpp_runner import LlamaCppRunner
    from slotserve.server.app import create_app
    from slotserve.server.lifecycle import GracefulServer
    from slotserve.server.log_context import configure_logging
    from slotserve.server.metrics import ServerMetrics
    from slotserve.server.model_host import ModelHost
    from slotserve.server.serving import ServingContext

    configure_logging(args.log_level)
    try:
        model_path = resolve_model_path(args.model)
        budget_tokens, budget_bytes = args.prefix_cache_budget or (None, None)
        config = EngineConfig(
            num_slots=args.slots,
            max_batch_tokens=args.max_batch_tokens,
            prefill_chunk=args.prefill_chunk,
            max_queue=args.max_queue,
            prefix_cache=args.prefix_cache,
            prefix_cache_budget_tokens=budget_tokens,
            prefix_cache_budget_bytes=budget_bytes,
            prefix_wait_min_tokens=args.prefix_wait_min_tokens,
            request_timeout_s=args.request_timeout or None,
            slow_step_warn_s=args.slow_step_warn,
            slow_queue_warn_s=args.slow_queue_warn,
        )
        template_file = Path(args.chat_template) if args.chat_template else None
        if template_file is not None and not template_file.is_file():
            raise ValueError(f"chat template file not found: {template_file}")
        if args.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
    except (ModelUnavailableError, ValueError) as exc:
        print(f"slotserve: {exc}", file=sys.stderr)
        return 2
    model_name = args.served_model_name or model_path.stem

    def build_runner() -> LlamaCppRunner:
        return LlamaCppRunner(
            model_path,
            num_slots=args.slots,
            ctx_size=args.ctx_size,
            max_batch_tokens=args.max_batch_tokens,
            n_threads=args.threads or None,
            flash_attn=args.flash_attn,
            model_name=model_name,
        )

    metrics = ServerMetrics(model_name)
    host = ModelHost(model_name, build_runner, config, template_file, metrics.observe)
    ctx = ServingContext(host, metrics, api_key=args.api_key or None)
    uvicorn_config = uvicorn.Config(
        create_app(ctx),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # keep ours: every line names its request
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    GracefulServer(uvicorn_config, host, args.shutdown_timeout).run()
    if host.load_error is not None and host.loads == 0:
        return 1  # the model never loaded
    return 0


def reload(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.post(f"{args.url}/admin/reload", headers=headers, timeout=600)
    except httpx.HTTPError as exc:
        print(f"slotserve: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(response.text)
    return 0 if response.status_code == 200 else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "sweep"]:
        from slotserve.bench.sweep import main_sweep

        return main_sweep(build_sweep_parser().parse_args(argv[2:]))
    if argv[:2] == ["bench", "prefix-cache"]:
        from slotserve.bench.prefix_ab import main_prefix_ab

        return main_prefix_ab(build_prefix_ab_parser().parse_args(argv[2:]))
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "reload":
        return reload(args)
    if args.command == "bench":
        from slotserve.bench.cli import main_bench

        return main_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
