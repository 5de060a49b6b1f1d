"""``slotserve serve``: its flags, the runner chosen for the model, and the server's start
(SPEC C1, S5, R1, R2)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from slotserve.engine.runner_interface import RunnerSpec
from slotserve.options import env, env_bool, env_float, env_int, parse_bytes, parse_cache_budget
from slotserve.runners.specs import LlamaCppSpec, TorchSpec
from slotserve.server.reasoning import REASONING_PARSERS
from slotserve.server.tool_parsers import TOOL_PARSERS


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=env("MODEL"),
        help="a GGUF file, an HF model folder, or an HF model id in the local cache "
        "(default: the embedded SmolLM2-135M-Instruct GGUF)",
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
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(also disable_by_batch_size, default 2, and min_acceptance_rate, default the "
        "runner's break-even rate: 0.5 on llama.cpp, 0.2 on torch); "
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
        choices=["auto", "llama.cpp", "torch"],
        default=env("RUNNER", "auto"),
        help="auto: llama.cpp for a .gguf file, torch for an HF folder or cached model id",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=env("DTYPE", "auto"),
        help="torch: weight and KV type (auto: bfloat16, batch-invariant on CPU)",
    )
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
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


def runner_factory(args: argparse.Namespace, model_path: Path, model_name: str) -> RunnerSpec:
    """What ``--runner`` (or the model's form) picks; validates the choice before any load."""
    kind = args.runner
    if kind == "auto":
        kind = "llama.cpp" if model_path.is_file() else "torch"
    if kind == "llama.cpp":
        if not model_path.is_file():
            raise ValueError(f"the llama.cpp runner needs a .gguf file, not {model_path}")
        return LlamaCppSpec(
            model_path,
            num_slots=args.slots,
            ctx_size=args.ctx_size,
            max_batch_tokens=args.max_batch_tokens,
            n_threads=args.threads or None,
            flash_attn=args.flash_attn,
            model_name=model_name,
        )
    try:
        from slotserve.runners.pytorch.runner import TorchLoadConfig, read_model_config
    except ImportError as exc:
        raise ValueError(
            f"the PyTorch runner needs its dependencies ({exc.name} is missing): "
            "pip install -e '.[torch]' (make install-torch)"
        ) from exc

    load = TorchLoadConfig(
        model_path,
        num_slots=args.slots,
        max_batch_tokens=args.max_batch_tokens,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_seq_len=args.max_model_len,
        kv_memory_bytes=args.kv_memory or 0,
        gpu_memory_fraction=args.gpu_memory_fraction,
        block_size=args.block_size,
        threads=args.threads,
        model_name=model_name,
    )
    read_model_config(model_path)  # unsupported architectures fail here, before any weight
    return TorchSpec(load)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from slotserve.engine.config import EngineConfig
    from slotserve.engine.speculative import SpeculativeConfig
    from slotserve.model_source import ModelUnavailableError, resolve_model_path
    from slotserve.server.app import create_app
    from slotserve.server.lifecycle import GracefulServer
    from slotserve.server.log_context import configure_logging
    from slotserve.server.metrics import ServerMetrics
    from slotserve.server.model_host import ModelHost
    from slotserve.server.reasoning import get_reasoning_parser
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
            speculative=(
                SpeculativeConfig.from_json(args.speculative_config)
                if args.speculative_config
                else None
            ),
        )
        template_file = Path(args.chat_template) if args.chat_template else None
        if template_file is not None and not template_file.is_file():
            raise ValueError(f"chat template file not found: {template_file}")
        if args.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        model_name = args.served_model_name or default_model_name(model_path)
        build_runner = runner_factory(args, model_path, model_name)
    except (ModelUnavailableError, ValueError, FileNotFoundError) as exc:
        print(f"slotserve: {exc}", file=sys.stderr)
        return 2
    metrics = ServerMetrics(model_name)
    host = ModelHost(
        model_name,
        build_runner,
        config,
        template_file,
        metrics.observe,
        engine_process=args.engine_process,
        process_setup=functools.partial(configure_logging, args.log_level),
    )
    ctx = ServingContext(
        host,
        metrics,
        api_key=args.api_key or None,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=(
            get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
        ),
    )
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


def default_model_name(model_path: Path) -> str:
    if model_path.is_file():
        return model_path.stem
    # An HF cache snapshot: models--org--name/snapshots/<revision>
    if model_path.parent.name == "snapshots":
        return model_path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return model_path.name
