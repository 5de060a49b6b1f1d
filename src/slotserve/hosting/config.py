"""What the served models are built from, as options (``slotserve.options``): which models are
served (:class:`ModelsConfig`), and each model's runner (:class:`RunnerConfig`: the llama.cpp
runner's :class:`LlamaCppConfig` and the PyTorch runner's :class:`TorchConfig` together,
declared in ``runners/options.py``), chat
handling (:class:`ModelOptions`) and engine (``EngineConfig``), together a
:class:`LaunchConfig`, which ``POST /models/load`` overrides one model at a time
(:func:`load_request_model` is its body)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, Field, create_model

from slotserve.engine.config import EngineConfig
from slotserve.engine.sampling_defaults import DEFAULTED, LLAMA_SERVER, NEUTRAL, SamplingDefaults
from slotserve.options import option, options, repeated_option
from slotserve.protocol.media import MediaPolicy
from slotserve.protocol.reasoning import REASONING_PARSERS
from slotserve.protocol.tool_parsers import TOOL_PARSERS
from slotserve.runners.options import LlamaCppConfig, TorchConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENGINE_RESTART = ("always", "never")

_C = TypeVar("_C", bound="DataclassInstance")
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True)
class ModelsConfig:
    """The models one server serves: those it loads at start-up, and a folder of models it
    loads by name."""

    model: str | None = option(
        None,
        flag="model",
        metavar="MODEL_PATH",
        help="a GGUF file, an HF model folder, or an HF model id in the local cache "
        "(default: the embedded SmolLM2-135M-Instruct GGUF, unless --model or --models-dir "
        "names models)",
    )
    models: tuple[str, ...] = option(
        (),
        flag="--model",
        aliases=("-m", "--model-path"),
        dest="models",
        env=None,
        metavar="PATH[=NAME]",
        help="serve this model too, under NAME (default: its file name); repeat for several. "
        "Each has its own engine, slots and runner, built from the per-model options",
    )
    served_model_name: str | None = option(
        None,
        aliases=("--alias", "-a"),
        help="model id clients use for MODEL_PATH (default: the GGUF file name)",
    )
    models_dir: str | None = option(
        None,
        help="a folder of models served by name (a GGUF file by its name without .gguf, a "
        "sub-folder by its name); loaded on first use",
    )
    models_autoload: bool = option(
        True,
        help="load a --models-dir model when a request names it (default on; "
        "--no-models-autoload: only POST /models/load loads)",
    )
    models_max: int = option(
        4,
        help="models loaded at once; loading one more unloads the least recently used idle "
        "model (default 4; 0: no limit)",
    )
    unload_timeout: float = option(
        30.0,
        help="seconds POST /models/unload lets a model's requests in flight finish before "
        "cutting them off (default 30)",
    )


@dataclass(frozen=True, kw_only=True)
class RunnerConfig(TorchConfig, LlamaCppConfig):
    """Both runners' options, as ``serve`` parses them and ``POST /models/load`` takes them
    (the runner is picked at load, from ``runner`` or the model's form); an instance is each
    runner's config, and each runner's recipe reads only its own. Its slots and batch size are
    the ``EngineConfig``'s."""


def _sampling_default(option_name: str, aliases: tuple[str, ...] = ()) -> Any:
    """The option that defaults a sampling field, its help from the field's declaration."""
    (declared,) = (d for d in DEFAULTED.values() if d.option == option_name)
    name = declared.name
    return option(
        None,
        aliases=aliases,
        help=f"a request's {name} when it leaves it out, {declared.range_text}: {declared.doc} "
        f"(default: the model's own, from generation_config.json or GGUF general.sampling.*, "
        f"else {getattr(LLAMA_SERVER, name):g} on llama.cpp as llama-server, "
        f"{getattr(NEUTRAL, name):g} on torch)",
    )


@dataclass(frozen=True)
class ModelOptions:
    """How a model's requests are rendered, its replies parsed, and its engine brought back
    when it dies."""

    chat_template: str | None = option(
        None,
        aliases=("--chat-template-file",),
        help="Jinja2 chat template file overriding the model's own",
    )
    tool_call_parser: str | None = option(
        None,
        choices=TOOL_PARSERS,
        help="format of the model's tool calls (vLLM's names; default: chosen from the chat "
        "template: <tool_call> → hermes, [TOOL_CALLS] → mistral, Llama 3 → llama3_json, "
        "none → generic, a JSON format described to the model in a system message)",
    )
    reasoning_parser: str | None = option(
        None,
        choices=REASONING_PARSERS,
        help="split <think>...</think> into message.reasoning_content (qwen3, deepseek_r1)",
    )
    # Images in requests (vLLM's flags): how many, and where URLs may be read from.
    limit_mm_per_prompt: str = option(
        '{"image": 8}',
        help='the most images one request may carry, as vLLM\'s JSON ({"image": N}; '
        'default {"image": 8})',
    )
    allowed_media_domains: tuple[str, ...] = repeated_option(
        "HOST",
        help="hosts whose http(s) image URLs are fetched, by name, address or CIDR range; "
        "repeat for several (default none: only data: URLs are read). A name's addresses must "
        "be public (no loopback, private, link-local, CGNAT or metadata address) unless an "
        "address or range listed here names them",
    )
    allowed_local_media_path: str | None = option(
        None,
        help="a folder whose files requests may name as file:// image URLs (default none)",
    )
    media_fetch_timeout: float = option(
        10.0,
        ge=0.1,
        help="seconds an image URL may take to fetch, all of it (name lookup, connection, "
        "body); a request's images are fetched together within it too (default 10)",
    )
    # llama-server's flag names; each is the default of a request that leaves the field out.
    temperature: float | None = _sampling_default("temperature", aliases=("--temp",))
    top_p: float | None = _sampling_default("top_p")
    top_k: int | None = _sampling_default("top_k")
    min_p: float | None = _sampling_default("min_p")
    repeat_penalty: float | None = _sampling_default("repeat_penalty")
    engine_restart: str = option(
        "always",
        choices=ENGINE_RESTART,
        help="always: when the engine dies (its process killed or crashed, or the runner "
        "failed) restart it with backoff; never: leave the model unhealthy until "
        "POST /admin/reload (default always)",
    )
    engine_restart_limit: int = option(
        5,
        ge=1,
        help="the engine's deaths within --engine-restart-window seconds that count as a crash "
        "loop: the model is then left failed, with the reason (default 5)",
    )
    engine_restart_window: float = option(
        300.0,
        ge=0,
        help="seconds over which --engine-restart-limit counts deaths (default 300)",
    )

    def __post_init__(self) -> None:
        bad = [DEFAULTED[b].option or b for b in self.sampling_defaults.out_of_range()]
        if bad:
            raise ValueError(f"sampling defaults out of range: {', '.join(bad)}")
        self.media_policy  # noqa: B018 (refuses a bad --limit-mm-per-prompt at start-up)

    @property
    def media_policy(self) -> MediaPolicy:
        return MediaPolicy.of(
            self.limit_mm_per_prompt,
            self.allowed_media_domains,
            self.allowed_local_media_path,
            self.media_fetch_timeout,
        )

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The sampling flags given, over the model's own defaults at load."""
        return SamplingDefaults(
            **{name: getattr(self, declared.option or name) for name, declared in DEFAULTED.items()}
        )


PER_MODEL: tuple[type[DataclassInstance], ...] = (EngineConfig, RunnerConfig, ModelOptions)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one model is built from."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    model: ModelOptions = field(default_factory=ModelOptions)

    def with_options(self, values: Mapping[str, Any]) -> LaunchConfig:
        """This configuration with ``POST /models/load``'s options over it, named as the
        options are (``ctx_size`` for ``--ctx-size``); ``ValueError`` for a bad one."""
        known = {opt.dest for cls in PER_MODEL for opt in options(cls).values()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown options: {', '.join(unknown)}")
        return LaunchConfig(
            _override(self.engine, values),
            _override(self.runner, values),
            _override(self.model, values),
        )


def _override(config: _C, values: Mapping[str, Any]) -> _C:
    changes = {
        opt.name: opt.read_json(values[opt.dest])
        for opt in options(type(config)).values()
        if opt.dest in values
    }
    return dataclasses.replace(config, **changes)


def load_request_model(base: type[_M], name: str) -> type[_M]:
    """``POST /models/load``'s body: ``base``'s fields and every per-model option, each
    optional, typed, bounded and described as declared, so that the OpenAPI schema shows
    them."""
    fields: dict[str, Any] = {}
    for cls in PER_MODEL:
        for opt in options(cls).values():
            kind: Any = opt.wire or opt.kind
            if opt.choices is not None:
                kind = Literal.__getitem__(opt.choices)
            fields[opt.dest] = (kind | None, Field(None, description=opt.help, ge=opt.ge))
    return create_model(name, __base__=base, __doc__=base.__doc__, **fields)
