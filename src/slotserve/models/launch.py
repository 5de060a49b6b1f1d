"""How each served model is built from ``slotserve serve``'s flags: at start-up (the
positional model, every ``--model PATH[=NAME]``), or by ``POST /models/load`` with options of
its own that override the flags."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotserve.options import parse_bytes
from slotserve.protocol.reasoning import REASONING_PARSERS
from slotserve.protocol.tool_parsers import TOOL_PARSERS
from slotserve.runners.specs import LlamaCppSpec, TorchSpec

if TYPE_CHECKING:
    from slotserve.engine.runner_interface import MemoryNeed, RunnerSpec
    from slotserve.models.host import ModelLaunch
    from slotserve.models.registry import LaunchFactory

RUNNERS = ("auto", "llama.cpp", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


def runner_factory(args: argparse.Namespace, model_path: Path, model_name: str) -> RunnerSpec:
    """What ``--runner`` (or the model's form) picks; validates the choice before any load."""
    kind = args.runner
    if kind == "auto":
        kind = "llama.cpp" if model_path.is_file() else "torch"
    if kind == "llama.cpp":
        if args.tensor_parallel_size != 1:
            raise ValueError(
                "--tensor-parallel-size is a PyTorch runner setting: add --runner torch"
            )
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
        from slotserve.runners.pytorch.checkpoint import TorchLoadConfig
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
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return TorchSpec(load)


def build_launch(
    args: argparse.Namespace, model_path: Path, name: str, at_startup: bool = False
) -> ModelLaunch:
    """One model from the serve flags: its runner, engine configuration, chat template and
    parsers, and its memory estimate (an unreadable model or an unsupported architecture
    fails here, before any weight is read; at start-up the load reports it instead, and the
    server exits with status 1)."""
    from slotserve.engine.config import EngineConfig, SpeculativeConfig
    from slotserve.models.host import ModelLaunch
    from slotserve.protocol.reasoning import get_reasoning_parser

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
    spec = runner_factory(args, model_path, name)
    return ModelLaunch(
        name,
        spec,
        config,
        template_file,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=(
            get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
        ),
        memory=_memory_needed(spec, at_startup),
        model_path=model_path,
    )


def _memory_needed(spec: RunnerSpec, at_startup: bool) -> MemoryNeed | None:
    """The estimate; a configuration the runner refuses (``ValueError``: an unsupported
    architecture) fails here. A file that cannot be read fails too, except at start-up, where
    the load reports it as a failed load (start-up models are not pre-flighted)."""
    try:
        return spec.memory_needed()
    except ValueError:
        raise
    except Exception:
        if at_startup:
            return None
        raise


# POST /models/load options checked as the flags' choices are.
_CHOICES = {
    "runner": RUNNERS,
    "dtype": DTYPES,
    "load_format": LOAD_FORMATS,
    "tool_call_parser": tuple(TOOL_PARSERS),
    "reasoning_parser": tuple(REASONING_PARSERS),
}


def launch_factory(base: argparse.Namespace) -> LaunchFactory:
    """How ``POST /models/load`` builds a model: the server's flags, overridden by the
    request's options (named as the flags are: ``ctx_size`` for ``--ctx-size``)."""

    def make(name: str, path: Path, options: Mapping[str, Any]) -> ModelLaunch:
        from slotserve.models.source import ModelUnavailableError, resolve_model_path

        values = dict(options)
        for key, allowed in _CHOICES.items():
            if values.get(key) is not None and values[key] not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}")
        if isinstance(values.get("kv_memory"), str):
            try:
                values["kv_memory"] = parse_bytes(values["kv_memory"])
            except argparse.ArgumentTypeError as exc:
                raise ValueError(str(exc)) from None
        if isinstance(values.get("speculative_config"), dict):
            values["speculative_config"] = json.dumps(values["speculative_config"])
        try:
            model_path = resolve_model_path(str(path))
        except ModelUnavailableError as exc:
            raise ValueError(str(exc)) from None
        return build_launch(argparse.Namespace(**(vars(base) | values)), model_path, name)

    return make


def startup_models(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """(path, name) of the models to load at start-up: the positional model, each
    ``--model PATH[=NAME]``; with neither and no ``--models-dir``, the embedded model."""
    from slotserve.models.source import resolve_model_path

    given: list[tuple[str | None, str | None]] = []
    if args.model:
        given.append((args.model, None))
    for item in args.models or []:
        path, sep, name = item.rpartition("=")
        given.append((path, name) if sep and name else (item, None))
    if not given and not args.models_dir:
        given.append((None, None))  # the embedded model
    models: list[tuple[Path, str]] = []
    for k, (where, name) in enumerate(given):
        model_path = resolve_model_path(where)
        name = name or (args.served_model_name if k == 0 else None)
        models.append((model_path, name or default_model_name(model_path)))
    names = [name for _, name in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"two models are named {', '.join(duplicates)}: give one another name "
            "(--model PATH=NAME)"
        )
    if 0 < args.models_max < len(models):
        raise ValueError(f"{len(models)} models were given but --models-max is {args.models_max}")
    return models


def default_model_name(model_path: Path) -> str:
    if model_path.is_file():
        return model_path.stem
    # An HF cache snapshot: models--org--name/snapshots/<revision>
    if model_path.parent.name == "snapshots":
        return model_path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return model_path.name
