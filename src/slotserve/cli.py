"""Command line: ``slotserve serve [MODEL_PATH]``, ``slotserve chat``, ``slotserve reload``,
``slotserve bench``, ``slotserve bench sweep``.

Every flag has a ``SLOTSERVE_*`` environment equivalent (``--ctx-size`` ↔
``SLOTSERVE_CTX_SIZE``); a flag given on the command line wins. docs/configuration.md lists
them all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from slotserve import __version__
from slotserve.options import env


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: a prefix would take whichever flag it begins today (llama-server's
    # "-t 2", threads, read as -tp 2), and a new flag could change what it means.
    parser = argparse.ArgumentParser(
        prog="slotserve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"slotserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API (GGUF: llama.cpp; HF folder: PyTorch)",
        allow_abbrev=False,
    )
    from slotserve.serve_config import add_serve_arguments

    add_serve_arguments(serve)
    chat = commands.add_parser(
        "chat",
        help="chat with a model in the terminal (in-process, or a running server with --url)",
        allow_abbrev=False,
    )
    from slotserve.chat.command import add_chat_arguments

    add_chat_arguments(chat)
    reload = commands.add_parser(
        "reload",
        help="ask a running server to reload its model (recovers an unhealthy one)",
        allow_abbrev=False,
    )
    reload.add_argument("--url", default=env("URL", "http://127.0.0.1:8000"))
    reload.add_argument("--api-key", default=env("API_KEY"))
    reload.add_argument("--model", help="the model to reload (default: the server's default)")
    bench = commands.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server ('bench sweep': slot sweep + peers; "
        "'bench prefix-cache': shared system prompt, cache on vs off; 'bench runners': "
        "PyTorch vs llama.cpp runner vs transformers; 'bench speculative': drafts on vs off; "
        "'bench model-file': a GGUF of a real model's shapes, quantized by llama.cpp)",
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


def build_runners_ab_parser() -> argparse.ArgumentParser:
    from slotserve.bench import runners_ab

    return _bench_subcommand_parser(
        "runners", runners_ab.__doc__, runners_ab.add_runners_ab_arguments
    )


def build_prefix_ab_parser() -> argparse.ArgumentParser:
    from slotserve.bench import prefix_ab

    return _bench_subcommand_parser(
        "prefix-cache", prefix_ab.__doc__, prefix_ab.add_prefix_ab_arguments
    )


def build_spec_ab_parser() -> argparse.ArgumentParser:
    from slotserve.bench import spec_ab

    return _bench_subcommand_parser("speculative", spec_ab.__doc__, spec_ab.add_spec_ab_arguments)


def build_model_file_parser() -> argparse.ArgumentParser:
    from slotserve.bench import model_files

    return _bench_subcommand_parser(
        "model-file", model_files.__doc__, model_files.add_model_file_arguments
    )


def reload(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        params = {"model": args.model} if args.model else {}
        response = httpx.post(
            f"{args.url}/admin/reload", params=params, headers=headers, timeout=600
        )
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
    if argv[:2] == ["bench", "runners"]:
        from slotserve.bench.runners_ab import main_runners_ab

        return main_runners_ab(build_runners_ab_parser().parse_args(argv[2:]))
    if argv[:2] == ["bench", "prefix-cache"]:
        from slotserve.bench.prefix_ab import main_prefix_ab

        return main_prefix_ab(build_prefix_ab_parser().parse_args(argv[2:]))
    if argv[:2] == ["bench", "speculative"]:
        from slotserve.bench.spec_ab import main_spec_ab

        return main_spec_ab(build_spec_ab_parser().parse_args(argv[2:]))
    if argv[:2] == ["bench", "model-file"]:
        from slotserve.bench.model_files import main_model_file

        return main_model_file(build_model_file_parser().parse_args(argv[2:]))
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from slotserve.serve_command import serve

        return serve(args, argv[1:])
    if args.command == "chat":
        from slotserve.chat.command import chat

        return chat(args)
    if args.command == "reload":
        return reload(args)
    if args.command == "bench":
        from slotserve.bench.cli import main_bench

        return main_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
