"""``slotserve chat [MODEL]`` and ``slotserve chat --url URL``: flags and start-up.

Without ``--url`` the model runs in this process, resolved and built as ``serve`` does it
(``resolve_model_path``, ``runner_factory``); its flags are some of ``serve``'s options
(:func:`local_options`), and those ``chat`` does not have keep ``serve``'s defaults (and their
``SLOTSERVE_*`` variables), but a reply has no time limit. With ``--url`` the replies come from
a running OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from slotserve.chat.backend import ChatBackend, ChatBackendError, GenerationOptions
from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import ModelOptions, RunnerConfig
from slotserve.options import Option, add_arguments, configure, env, options

if TYPE_CHECKING:
    from slotserve.chat.terminal import Screen

USAGE_ERROR = 2


DESCRIPTION = """\
Chat with a model in the terminal: the model in this process (MODEL, default the embedded
SmolLM2), or a running OpenAI-compatible server (--url).

At a terminal: Enter sends, Alt-Enter starts a new line, /help lists the commands, Ctrl-C stops
a reply (its text so far stays in the history), Ctrl-C at an empty prompt or Ctrl-D leaves.
With stdin not a terminal each non-empty line is one turn; replies go to stdout, status lines to
stderr."""


def local_options() -> list[Option]:
    """``serve``'s options that ``chat`` takes for the model in-process."""
    runner, engine = options(RunnerConfig), options(EngineConfig)
    slots = dataclasses.replace(
        engine["num_slots"],
        default=1,
        # Not SLOTSERVE_SLOTS: that one sizes servers, and a chat is one conversation.
        env="CHAT_SLOTS",
        help="sequences the engine holds (default 1: one conversation)",
        aliases=(),  # other servers' spellings are for serve's command lines
    )
    return [
        runner["runner"],
        slots,
        runner["ctx_size"],
        runner["max_model_len"],
        runner["threads"],
        options(ModelOptions)["chat_template"],
        runner["dtype"],
        runner["device"],
    ]


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model",
        nargs="?",
        help="run this model in-process: a GGUF file, an HF model folder, or an HF model id "
        "in the local cache (default: SLOTSERVE_MODEL, else the embedded SmolLM2 GGUF)",
    )
    remote = parser.add_argument_group("a running server instead")
    remote.add_argument(
        "--url", help="chat with the OpenAI-compatible server at URL (http://host:port[/v1])"
    )
    remote.add_argument(
        "--model-name", help="the model to ask for (default: the first of GET /v1/models)"
    )
    remote.add_argument("--api-key", default=env("API_KEY"), help="the server's API key")
    talk = parser.add_argument_group("the conversation")
    talk.add_argument(
        "--system-prompt", default=env("SYSTEM_PROMPT"), help="the conversation's system message"
    )
    talk.add_argument(
        "-q", "--quick", metavar="MESSAGE", help="send one message, print the reply, exit"
    )
    talk.add_argument(
        "--temperature",
        type=float,
        default=env("TEMPERATURE"),  # argparse converts a string default
        help="sampling temperature, 0 to 2 (default: the model's, as the server sets it)",
    )
    talk.add_argument(
        "--max-tokens",
        type=int,
        default=env("MAX_TOKENS"),
        help="most tokens per reply (default: the server's --max-tokens-default; in-process, "
        f"SLOTSERVE_MAX_TOKENS_DEFAULT or {options(EngineConfig)['max_tokens_default'].default})",
    )
    local = parser.add_argument_group("the model in-process (as for serve)")
    add_arguments(local, local_options())


def chat(args: argparse.Namespace) -> int:
    try:
        problem = _check(args)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        print(f"slotserve chat: {problem}", file=sys.stderr)
        return USAGE_ERROR
    _quiet_logging()
    try:
        return asyncio.run(_chat(args))
    except KeyboardInterrupt:  # Ctrl-C while the model loads or the server is asked
        return 130


def _check(args: argparse.Namespace) -> str | None:
    if args.url and args.model:
        return "give a MODEL to run in-process or --url for a running server, not both"
    if args.temperature is not None and not 0.0 <= args.temperature <= 2.0:
        return "--temperature must be between 0 and 2"
    if args.max_tokens is not None and args.max_tokens < 1:
        return "--max-tokens must be >= 1"
    if args.slots < 1:
        return "--slots must be >= 1"
    if args.chat_template and not Path(args.chat_template).is_file():
        return f"chat template file not found: {args.chat_template}"
    return None


async def _chat(args: argparse.Namespace) -> int:
    from slotserve.chat.session import ChatSession
    from slotserve.chat.terminal import Screen, run_interactive, run_lines, run_quick
    from slotserve.hosting.source import ModelUnavailableError

    screen = Screen.for_stdio()
    try:
        backend = await _open_backend(args, screen)
    except (ChatBackendError, ModelUnavailableError, ValueError, OSError) as exc:
        print(f"slotserve chat: {exc}", file=sys.stderr)
        return 1
    try:
        session = ChatSession(
            backend, args.system_prompt, GenerationOptions(args.temperature, args.max_tokens)
        )
        if args.quick is not None:
            return await run_quick(session, args.quick, screen)
        if sys.stdin.isatty():
            return await run_interactive(session, screen)
        return await run_lines(session, sys.stdin, screen)
    finally:
        await backend.close()


async def _open_backend(args: argparse.Namespace, screen: Screen) -> ChatBackend:
    from slotserve.chat.backend import EngineBackend, RemoteBackend

    if args.url:
        return await RemoteBackend.connect(args.url, args.api_key, args.model_name)

    from slotserve.hosting.launch import default_model_name, runner_factory
    from slotserve.hosting.source import resolve_model_path

    engine, runner = local_configs(args)
    model_path = resolve_model_path(args.model or env("MODEL"))
    name = default_model_name(model_path)
    spec = runner_factory(runner, engine, model_path, name)
    if screen.notes.is_terminal:
        screen.notes.print(f"loading {model_path} …", style="dim", soft_wrap=True)
    template = Path(args.chat_template) if args.chat_template else None
    return await EngineBackend.start(name, spec, engine, template)


def local_configs(args: argparse.Namespace) -> tuple[EngineConfig, RunnerConfig]:
    """The in-process model's engine and runner: chat's flags over ``serve``'s options."""
    engine = configure(EngineConfig, args)
    # Each turn's prompt starts with the previous one: the prefix cache (on unless
    # SLOTSERVE_PREFIX_CACHE says otherwise) makes it cheap. A reply at the terminal has no
    # time limit: Ctrl-C stops it.
    engine = dataclasses.replace(engine, request_timeout_s=None)
    return engine, configure(RunnerConfig, args)


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def _quiet_logging() -> None:
    """The engine's warnings in one line each; tracebacks belong in a server's log, and the
    failure that matters is also said by the chat itself."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("slotserve: %(message)s"))
    handler.addFilter(_NoTraceback())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
