"""One served model's life cycle: loading in the background, serving,
unhealthy after a runner failure, reloading, unloading, draining at shutdown.

::

    loading ──▶ ready ──runner failure──▶ unhealthy ──reload──▶ loading ──▶ ready
       │          │                                                 ▲
       ▼          └──────────────────── reload ─────────────────────┘
     failed (load error; reload retries)
    any ──unload──▶ unloading ──▶ (gone)       any ──SIGTERM──▶ draining ──▶ stopped

The HTTP server listens from the start: while the model loads, readiness fails and generation
requests get a 503 that says so. A reload builds a new runner and a new engine; requests still
in the old engine end first (their streams get an error). The models of a server, and which
of them are loaded, are the registry's (``registry.py``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slotserve.engine.client import make_client
from slotserve.engine.client.async_engine import AsyncEngine, OutputListener
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.stats import EngineStats, EngineTotals
from slotserve.engine.outputs import STOPPED_REASON
from slotserve.engine.runner_interface import MemoryNeed, ModelInfo, Runner, Tokenizer
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.protocol.reasoning import ReasoningParser

logger = logging.getLogger(__name__)

RELOAD_HINT = "POST /admin/reload (or run `slotserve reload`) to recover"


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

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats


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


@dataclass
class ModelHost:
    """Owns one model's runner recipe and current engine; routes reach it through the
    registry.

    With ``engine_process`` the engine core runs in a process of its own
    (``engine/client/mp_client.py``): ``launch.build_runner`` must then be a picklable
    ``RunnerSpec``, and ``process_setup`` runs first in that process (logging). Otherwise it
    runs on an engine thread of this process."""

    launch: ModelLaunch
    on_outputs: OutputListener | None = None
    engine_process: bool = False
    process_setup: Callable[[], None] | None = None
    model: LoadedModel | None = None
    load_error: str | None = None
    loads: int = 0
    # Counters of engines reloaded away (and of this name's earlier loads, after an unload).
    retired: EngineTotals = field(default_factory=EngineTotals)
    last_used: float = field(default_factory=time.monotonic)  # for --models-max's LRU
    keep_alive_s: float | None = None  # Ollama's keep_alive: unload when idle this long
    _loading: bool = False
    _unloading: bool = False
    _draining: bool = False
    _stopped: bool = False
    _load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def state(self) -> ModelState:
        if self._stopped:
            return ModelState.STOPPED
        if self._draining:
            return ModelState.DRAINING
        if self._unloading:
            return ModelState.UNLOADING
        if self._loading:
            return ModelState.LOADING
        if self.model is None:
            return ModelState.FAILED if self.load_error else ModelState.LOADING
        if self.model.engine.unhealthy is not None:
            return ModelState.UNHEALTHY
        return ModelState.READY

    @property
    def reason(self) -> str | None:
        """Why the model is not ready, in words (None when it is)."""
        state = self.state
        if state is ModelState.READY:
            return None
        if state is ModelState.UNHEALTHY:
            assert self.model is not None
            return f"the model is unhealthy after a runner failure ({self.model.engine.unhealthy})"
        if state is ModelState.FAILED:
            return f"the model failed to load ({self.load_error})"
        if state is ModelState.LOADING:
            return "the model is loading"
        if state is ModelState.UNLOADING:
            return "the model is being unloaded"
        return "the server is shutting down"

    def require_ready(self) -> LoadedModel:
        """The model, or ``ModelUnavailableError`` saying why not and what recovers it."""
        state = self.state
        if state is ModelState.READY:
            assert self.model is not None
            return self.model
        reason = self.reason
        if state in (ModelState.UNHEALTHY, ModelState.FAILED):
            raise ModelUnavailableError(f"{reason}; {RELOAD_HINT}.")
        if state is ModelState.LOADING:
            raise ModelUnavailableError(f"{reason}; retry shortly.", retry_after_s=5)
        if state is ModelState.UNLOADING:
            raise ModelUnavailableError(f"{reason}; load it again to use it (POST /models/load).")
        raise ModelUnavailableError(f"{reason}; no new requests are accepted.")

    async def load(self) -> None:
        """Loads (or reloads) the model; on failure the state is FAILED with the reason."""
        if self._draining or self._stopped:
            raise ReloadConflictError("the server is shutting down")
        if self._unloading:
            raise ReloadConflictError(f"the model {self.name} is being unloaded")
        if self._load_lock.locked():
            raise ReloadConflictError("a load is already in progress")
        async with self._load_lock:
            self._loading = True
            try:
                old, self.model = self.model, None
                if old is not None:
                    await self._retire(old)
                started = time.monotonic()
                self.model = await self._build()
                self.load_error = None
                self.loads += 1
                logger.info(
                    "model %s ready in %.1f s (load %d)",
                    self.name,
                    time.monotonic() - started,
                    self.loads,
                )
            except Exception as exc:
                logger.exception("loading the model %s failed", self.name)
                self.load_error = f"{type(exc).__name__}: {exc}"
            finally:
                self._loading = False

    async def _build(self) -> LoadedModel:
        """The runner (slow: reads the weights) and an engine over it, in the engine's own
        process or thread (``make_client``), which then starts serving."""

        launch = self.launch
        engine = await AsyncEngine.connect(
            lambda deliver: make_client(
                launch.build_runner,
                launch.config,
                deliver,
                engine_process=self.engine_process,
                process_setup=self.process_setup,
            ),
            self.on_outputs,
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
        return LoadedModel(engine, engine.tokenizer, info, template)

    async def _retire(self, model: LoadedModel, reason: str = STOPPED_REASON) -> None:
        """Stops an engine; whatever is still in it ends with an error saying ``reason``."""
        self.retired = self.retired.plus(model.stats, _forward_seconds(model))
        try:
            await model.engine.shutdown(reason)
        except Exception:  # a broken device may fail to free; the new runner starts clean
            logger.exception("closing the old runner failed")

    def begin_drain(self) -> None:
        """Stops admitting requests (503); in-flight ones go on."""
        self._draining = True

    def totals(self) -> EngineTotals:
        """Engine counters since the server started, across reloads."""
        model = self.model
        if model is None:
            return self.retired
        return self.retired.plus(model.stats, _forward_seconds(model))

    @property
    def num_in_flight(self) -> int:
        return self.model.engine.num_in_flight if self.model is not None else 0

    async def drain(
        self, timeout_s: float, cut_short: asyncio.Event | None = None, poll_s: float = 0.05
    ) -> int:
        """Waits up to ``timeout_s`` (or until ``cut_short`` is set) for in-flight requests to
        finish, then aborts the rest (each gets its final output, ``finish_reason`` "abort")
        and waits for their streams to close; returns how many were aborted."""
        self.begin_drain()
        await self._wait_idle(timeout_s, cut_short, poll_s)
        aborted = self.model.engine.abort_all() if self.model is not None else 0
        if aborted:
            logger.warning("shutdown deadline reached: aborting %d requests", aborted)
            flush_deadline = time.monotonic() + 5.0
            while self.num_in_flight and time.monotonic() < flush_deadline:
                await asyncio.sleep(poll_s)
        return aborted

    async def _wait_idle(
        self, timeout_s: float, cut_short: asyncio.Event | None = None, poll_s: float = 0.05
    ) -> None:
        """Until no request is in flight, ``timeout_s`` passes or ``cut_short`` is set."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            if cut_short is not None and cut_short.is_set():
                break
            await asyncio.sleep(poll_s)

    async def stop(self) -> None:
        self._draining = True
        model, self.model = self.model, None
        if model is not None:
            await self._retire(model)
        self._stopped = True

    async def unload(self, timeout_s: float, force: bool) -> int:
        """Refuses new requests (503), lets those in flight finish for up to ``timeout_s``
        (``force``: not at all), then stops the engine: what is still running ends with an
        error saying the model was unloaded. Returns how many requests were cut off."""
        self._unloading = True
        if not force:
            await self._wait_idle(timeout_s)
        cut_off = self.num_in_flight
        async with self._load_lock:  # a load in progress finishes (or fails) first
            model, self.model = self.model, None
            if model is not None:
                how = "with force" if force else f"after waiting {timeout_s:g} s"
                await self._retire(model, f"the model {self.name} was unloaded ({how})")
        self._stopped = True
        return cut_off


def _forward_seconds(model: LoadedModel) -> float:
    try:
        return model.engine.forward_seconds
    except Exception:  # a broken device may fail to answer
        return 0.0
