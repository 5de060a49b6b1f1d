"""How each served model is built from its configuration (``hosting/config.py``): at
start-up (the positional model, every ``--model PATH[=NAME]``), or by ``POST /models/load``
with options of its own over the server's."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotserve.hosting.config import LaunchConfig, ModelsConfig, RunnerConfig
from slotserve.options import option_values, options
from slotserve.runners.options import LlamaCppConfig, RunnerCommon, TorchConfig
from slotserve.runners.specs import LlamaCppSpec, TorchSpec

if TYPE_CHECKING:
    from slotserve.engine.config import EngineConfig
    from slotserve.engine.memory_need import MemoryNeed
    from slotserve.engine.runner_interface import RunnerSpec
    from slotserve.hosting.registry import LaunchFactory
    from slotserve.hosting.served import ModelLaunch

logger = logging.getLogger(__name__)

# Recurrent-state snapshots per slot by default (--prefix-cache-snapshots): a conversation's
# next turn, a shared prefix's branch point and a few spaced points per running prompt.
SNAPSHOTS_PER_SLOT = 4


def runner_factory(
    runner: RunnerConfig, engine: EngineConfig, model_path: Path, model_name: str
) -> RunnerSpec:
    """What ``--runner`` (or the model's form) picks, sized by the engine's slots and batch;
    validates the choice before any load."""
    if runner.runner == "auto":
        kind, why = auto_runner(runner, model_path)
    else:
        kind, why = runner.runner, f"--runner {runner.runner}"
    runner = runner_settings(runner, kind, engine.num_slots)
    spec: RunnerSpec = (
        llama_cpp_spec(runner, engine, model_path, model_name)
        if kind == "llama.cpp"
        else torch_spec(runner, engine, model_path, model_name)
    )
    logger.info("%s: served by the %s runner (%s)", model_name, _RUNNER_NAMES[kind], why)
    return spec


# Each runner by its --runner value: its name as users read it, its own settings.
_RUNNER_NAMES = {"llama.cpp": "llama.cpp", "torch": "PyTorch"}
_RUNNER_CONFIGS = {"llama.cpp": LlamaCppConfig, "torch": TorchConfig}
# A sequence's room, which either runner reads in its own spelling or the other's.
_SEQUENCE_ROOM = frozenset({"ctx_size", "max_model_len"})


def auto_runner(config: RunnerConfig, model_path: Path) -> tuple[str, str]:
    """``--runner auto``'s choice, and why: an HF checkpoint on the PyTorch runner; a .gguf
    file on the runner whose own settings were given, else on the PyTorch runner where it
    serves the file's weights as stored (its architecture, its quantized types, its CPU
    kernels or a GPU), else on llama.cpp."""
    if not model_path.is_file():
        return "torch", "--runner auto, an HF checkpoint"
    compare = "docs/runners.md compares the two"
    for kind, other in (("llama.cpp", "torch"), ("torch", "llama.cpp")):
        own = _settings_only_for(config, kind, skip=_SEQUENCE_ROOM)
        if own and not _settings_only_for(config, other, skip=_SEQUENCE_ROOM):
            return kind, f"--runner auto, a .gguf file and {', '.join(own)}, which only it reads"
    adapters = [parse_lora_module(text)[1] for text in config.lora_modules]
    if any(path.endswith(".gguf") for path in adapters):
        return "llama.cpp", f"--runner auto, a .gguf file and GGUF adapters; {compare}"
    try:
        from slotserve.runners.pytorch.load.format_choice import gguf_refusal
    except ImportError as exc:
        refusal: str | None = f"its dependencies are not installed ({exc.name}; make install-torch)"
    else:
        refusal = gguf_refusal(model_path, config.device)
    if refusal is not None:
        return "llama.cpp", f"--runner auto, a .gguf file; not the PyTorch runner: {refusal}"
    return "torch", (
        "--runner auto, a .gguf file it serves from its weights as stored; --runner llama.cpp "
        f"serves it on llama.cpp, {compare}"
    )


def _settings_only_for(
    config: RunnerConfig, kind: str, skip: frozenset[str] = frozenset()
) -> list[str]:
    """The flags given (away from their defaults) of settings only the ``kind`` runner reads;
    a switch turned off named as it was given: --no-flash-attn."""
    other = _RUNNER_CONFIGS["torch" if kind == "llama.cpp" else "llama.cpp"]
    other_options = options(other)
    return [
        "--no-" + declared.flag[2:] if getattr(config, name) is False else declared.flag
        for name, declared in options(_RUNNER_CONFIGS[kind]).items()
        if name not in other_options
        and name not in skip
        and getattr(config, name) != declared.default
    ]


def runner_settings(config: RunnerConfig, kind: str, slots: int) -> RunnerConfig:
    """``config`` as the ``kind`` runner reads it: a sequence's room in the other runner's
    spelling taken as its own (llama.cpp's ``--ctx-size`` counts every slot's tokens, vLLM's
    ``--max-model-len`` one sequence's), so that a command line serves on either runner; any
    other setting of the other runner's alone refused, never silently ignored."""
    if kind == "llama.cpp" and config.max_model_len and not config.ctx_size:
        config = replace(config, ctx_size=config.max_model_len * slots, max_model_len=0)
    elif kind == "torch" and config.ctx_size and not config.max_model_len:
        config = replace(config, max_model_len=max(config.ctx_size // slots, 1), ctx_size=0)
    other_kind = "torch" if kind == "llama.cpp" else "llama.cpp"
    unused = _settings_only_for(config, other_kind)
    if unused:
        one = len(unused) == 1
        other_name = _RUNNER_NAMES[other_kind]
        what = f"a {other_name} runner setting" if one else f"{other_name} runner settings"
        fix = (
            "add --runner torch"
            if kind == "llama.cpp"
            else f"drop {'it' if one else 'them'}, or serve a .gguf file with --runner llama.cpp"
        )
        raise ValueError(
            f"{', '.join(unused)}: {what}, unused by the {_RUNNER_NAMES[kind]} runner serving this "
            f"model: {fix}"
        )
    return config


def llama_cpp_spec(
    config: LlamaCppConfig, engine: EngineConfig, model_path: Path, model_name: str
) -> LlamaCppSpec:
    if not model_path.is_file():
        raise ValueError(f"the llama.cpp runner needs a .gguf file, not {model_path}")
    return LlamaCppSpec(
        model_path,
        **_recipe_settings(config, LlamaCppConfig, engine),
        model_name=model_name,
        num_slots=engine.num_slots,
        max_batch_tokens=engine.max_batch_tokens,
    )


def torch_spec(
    config: TorchConfig, engine: EngineConfig, model_path: Path, model_name: str
) -> TorchSpec:
    try:
        from slotserve.runners.pytorch.load.settings import TorchLoadConfig
    except ImportError as exc:
        raise ValueError(
            f"the PyTorch runner needs its dependencies ({exc.name} is missing): "
            "pip install -e '.[torch]' (make install-torch)"
        ) from exc

    load = TorchLoadConfig(
        model_path,
        **_recipe_settings(config, TorchConfig, engine),
        model_name=model_name,
        num_slots=engine.num_slots,
        max_batch_tokens=engine.max_batch_tokens,
    )
    return TorchSpec(load)


def _recipe_settings(
    config: RunnerCommon, runner: type[RunnerCommon], engine: EngineConfig
) -> dict[str, Any]:
    """The ``runner``'s options as given, its adapters' texts parsed and its recurrent-state
    snapshots resolved (what a recipe holds beyond the model and the engine's sizes)."""
    return option_values(config, runner) | {
        "lora_modules": tuple(parse_lora_module(text) for text in config.lora_modules),
        "prefix_cache_snapshots": _state_snapshots(config, engine),
    }


def parse_lora_module(text: str) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` forms: ``name=path``, or a JSON object with ``name`` and
    ``path``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text}: a JSON object needs name and path") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text}: expected NAME=PATH")
    return name, path


def _state_snapshots(runner: RunnerCommon, engine: EngineConfig) -> int:
    """Recurrent-state snapshots for the prefix cache: none when the cache is off."""
    if not engine.prefix_cache:
        return 0
    if runner.prefix_cache_snapshots is not None:
        return runner.prefix_cache_snapshots
    return SNAPSHOTS_PER_SLOT * engine.num_slots


def build_launch(
    config: LaunchConfig, model_path: Path, name: str, at_startup: bool = False
) -> ModelLaunch:
    """One model: its runner, engine configuration, chat template and parsers, and its memory
    estimate (an unreadable model or an unsupported architecture fails here, before any
    weight is read; at start-up the load reports it instead, and the server exits with
    status 1)."""
    from slotserve.hosting.served import ModelLaunch, RestartPolicy
    from slotserve.protocol.reasoning import get_reasoning_parser

    chat = config.model
    template_file = Path(chat.chat_template) if chat.chat_template else None
    if template_file is not None and not template_file.is_file():
        raise ValueError(f"chat template file not found: {template_file}")
    spec = runner_factory(config.runner, config.engine, model_path, name)
    return ModelLaunch(
        name,
        spec,
        config.engine,
        template_file,
        tool_call_parser=chat.tool_call_parser,
        reasoning_parser=(
            get_reasoning_parser(chat.reasoning_parser) if chat.reasoning_parser else None
        ),
        memory=_memory_needed(spec, at_startup),
        model_path=model_path,
        sampling=chat.sampling_defaults,
        restart=RestartPolicy(
            chat.engine_restart == "always", chat.engine_restart_limit, chat.engine_restart_window
        ),
        media=chat.media_policy,
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


def launch_factory(base: LaunchConfig) -> LaunchFactory:
    """How ``POST /models/load`` builds a model: the server's configuration with the
    request's options over it."""

    def make(name: str, path: Path, options: Mapping[str, Any]) -> ModelLaunch:
        from slotserve.hosting.source import ModelUnavailableError, resolve_model_path

        config = base.with_options(options)
        try:
            model_path = resolve_model_path(str(path))
        except ModelUnavailableError as exc:
            raise ValueError(str(exc)) from None
        return build_launch(config, model_path, name)

    return make


def startup_models(models: ModelsConfig) -> list[tuple[Path, str]]:
    """(path, name) of the models to load at start-up: the positional model, each
    ``--model PATH[=NAME]``; with neither and no ``--models-dir``, the embedded model."""
    from slotserve.hosting.source import resolve_model_path

    given: list[tuple[str | None, str | None]] = []
    if models.model:
        given.append((models.model, None))
    for item in models.models:
        path, sep, name = item.rpartition("=")
        given.append((path, name) if sep and name else (item, None))
    if not given and not models.models_dir:
        given.append((None, None))  # the embedded model
    found: list[tuple[Path, str]] = []
    for k, (where, name_given) in enumerate(given):
        model_path = resolve_model_path(where)
        named = name_given or (models.served_model_name if k == 0 else None)
        found.append((model_path, named or default_model_name(model_path)))
    names = [name for _, name in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"two models are named {', '.join(duplicates)}: give one another name "
            "(--model PATH=NAME)"
        )
    if 0 < models.models_max < len(found):
        raise ValueError(f"{len(found)} models were given but --models-max is {models.models_max}")
    return found


def default_model_name(model_path: Path) -> str:
    if model_path.is_file():
        return model_path.stem
    # An HF cache snapshot: models--org--name/snapshots/<revision>
    if model_path.parent.name == "snapshots":
        return model_path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return model_path.name
