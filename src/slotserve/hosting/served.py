"""What one served model is: its recipe (``ModelLaunch``, with the ``RestartPolicy`` for when
its engine dies), what the recipe builds (``LoadedModel``: the engine, tokenizer, chat template
and sampling defaults; :func:`build_model`), the states it goes through, and what a caller is
told when it cannot serve. ``host.py`` moves one model through those states."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slotserve.engine.client import make_client
from slotserve.engine.client.async_engine import AsyncEngine, OutputListener
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.stats import EngineStats
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.runner_interface import (
    AdapterInfo,
    ModelInfo,
    Runner,
    Tokenizer,
)
from slotserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.protocol.media import MediaPolicy
from slotserve.protocol.reasoning import ReasoningParser
from slotserve.protocol.score_pairs import carries_pair_roles

RELOAD_HINT = "POST /admin/reload (or run `slotserve reload`) to recover"
RESTART_BACKOFF_S = 0.25  # the first restart's delay; each quick death doubles it
RESTART_BACKOFF_MAX_S = 30.0
# An engine that served this long before it died was not crashing at start: its restart waits
# the first delay again (deaths still count towards a crash loop within the window).
RESTART_STABLE_S = 30.0
LOADING_RETRY_AFTER_S = 5  # the Retry-After of a request refused while the model loads

logger = logging.getLogger(__name__)


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"
    UNLOADING = "unloading"
    DRAINING = "draining"
    STOPPED = "stopped"


class ModelUnavailableError(Exception):
    """The model cannot take requests now (loading, unhealthy, draining): HTTP 503."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReloadConflictError(Exception):
    """A reload was asked for while one is running or the server is shutting down."""


@dataclass(frozen=True)
class LoadedModel:
    engine: AsyncEngine
    tokenizer: Tokenizer
    info: ModelInfo
    chat_template: ChatTemplate | None
    # The sampling fields' defaults in force: the server's flags over the model's own.
    sampling_defaults: SamplingDefaults = NEUTRAL
    # The LoRA adapters its engine holds, by name: those loaded with it, then as the adapter
    # routes load and unload them (an engine restart starts again from ``info.adapters``).
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def forward_seconds(self) -> float:
        try:
            return self.engine.forward_seconds
        except Exception:  # a broken device may fail to answer
            return 0.0


@dataclass(frozen=True)
class RestartPolicy:
    """What happens when the engine dies: restarted (``enabled``) after a backoff that doubles
    with each death that follows the last (re)start within ``RESTART_STABLE_S``, until the
    ``limit``-th death within ``window_s`` seconds (a crash loop) leaves the model failed."""

    enabled: bool = True
    limit: int = 5
    window_s: float = 300.0

    @staticmethod
    def quick_deaths_after(quick_deaths: int, served_s: float) -> int:
        """The deaths in a row once the engine died after serving ``served_s`` seconds (0: it
        never became ready), ``quick_deaths`` before."""
        return 1 if served_s >= RESTART_STABLE_S else quick_deaths + 1

    def backoff_s(self, quick_deaths: int) -> float:
        """The delay before a restart, after ``quick_deaths`` deaths in a row, each within
        ``RESTART_STABLE_S`` of the engine's start (the first counts as one)."""
        return min(RESTART_BACKOFF_S * 2.0 ** max(quick_deaths - 1, 0), RESTART_BACKOFF_MAX_S)


@dataclass(frozen=True)
class ModelLaunch:
    """How to build one served model: from the command line, or from ``POST /models/load``
    with its own options (``launch.py`` makes these)."""

    name: str
    build_runner: Callable[[], Runner]  # a RunnerSpec when the engine runs in a process
    config: EngineConfig
    chat_template_file: Path | None = None
    tool_call_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: ReasoningParser | None = None
    memory: MemoryNeed | None = None  # the pre-flight estimate (None: not known)
    model_path: Path | None = None  # where the weights are (the worker routes report it)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # the sampling flags
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # images a request may send


async def build_model(
    launch: ModelLaunch,
    on_outputs: OutputListener | None,
    engine_process: bool,
    process_setup: Callable[[], None] | None,
) -> LoadedModel:
    """The runner (slow: reads the weights) and an engine over it, in the engine's own
    process or thread (``make_client``; ``ModelHost`` says when which), which then starts
    serving; its chat template and sampling defaults."""
    engine = await AsyncEngine.connect(
        lambda deliver: make_client(
            launch.build_runner,
            launch.config,
            deliver,
            engine_process=engine_process,
            process_setup=process_setup,
        ),
        on_outputs,
    )
    info = engine.model_info
    try:
        source = (
            launch.chat_template_file.read_text()
            if launch.chat_template_file
            else info.chat_template
        )
        template = ChatTemplate(source, info.bos_token, info.eos_token) if source else None
    except BaseException:
        await engine.shutdown()
        raise
    if info.cross_encoder and not info.bidirectional and not carries_pair_roles(template):
        logger.warning(
            "model %s is a decoder reranker and its chat template writes no query and "
            "document messages: each pair is scored as its two texts one after the other, "
            "not in the prompt it was trained on (Qwen3-Reranker's instruction); give that "
            "prompt with --chat-template (docs/api.md#rerank-and-score)",
            launch.name,
        )
    defaults = launch.sampling.over(info.sampling_defaults)
    adapters = {adapter.name: adapter for adapter in info.adapters}
    return LoadedModel(engine, engine.tokenizer, info, template, defaults, adapters)
