"""The models one server serves, after llama-server's router mode: those given on
the command line (loaded at start-up), those of ``--models-dir`` (loaded on first use unless
``--no-models-autoload``), and those ``POST /models/load`` names. Each has its own
``ModelHost``: engine, slots, runner, and its own failures.

Requests route by ``model``. Loading past ``--models-max`` first unloads the least recently
used idle model; a memory pre-flight refuses (400) a model whose estimate does not fit, before
anything is loaded. Ollama's per-request ``keep_alive`` unloads a model once it has been idle
that long. An unload refuses new requests at once and lets those in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotserve.engine.client.async_engine import OutputListener
from slotserve.engine.core.stats import EngineTotals
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.outputs import RequestOutput
from slotserve.hosting.catalog import scan_models_dir
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import ModelLaunch, ModelState, ModelUnavailableError

logger = logging.getLogger(__name__)

# (name, path, options) → how to build it; raises for bad options or an unreadable model (400).
LaunchFactory = Callable[[str, Path, Mapping[str, Any]], ModelLaunch]
# The per-request metrics: (model name, one step's outputs).
ModelListener = Callable[[str, list[RequestOutput]], None]

IDLE_CHECK_S = 0.25  # how often keep_alive deadlines are checked
PREFLIGHT_HEADROOM_BYTES = 256 * 2**20
_ACTIVE = (ModelState.LOADING, ModelState.READY, ModelState.UNHEALTHY, ModelState.FAILED)


class ModelNotFoundError(Exception):
    """No model of that name is loaded or can be loaded: HTTP 404."""


class ModelLoadError(Exception):
    """``POST /models/load`` refused or failed: 400 (options, memory), 404 (no such model in
    the models dir), 409 (the name is taken, every model busy), 500 (the load failed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MemoryReading:
    available_bytes: int  # MemAvailable: what the kernel can give without swapping
    total_bytes: int


def read_memory() -> MemoryReading:
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MemoryReading(fields.get("MemAvailable", total), total)


def free_gpu_bytes() -> int | None:
    try:
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None
    except Exception:  # no torch, or no usable device: nothing to check against
        return None


class ModelRegistry:
    def __init__(
        self,
        make_launch: LaunchFactory | None = None,
        *,
        on_outputs: ModelListener | None = None,
        models_dir: Path | None = None,
        autoload: bool = True,
        models_max: int = 4,
        unload_timeout_s: float = 30.0,
        engine_process: bool = False,
        process_setup: Callable[[], None] | None = None,
        read_memory: Callable[[], MemoryReading] = read_memory,
    ) -> None:
        self.make_launch = make_launch
        self.on_outputs = on_outputs
        self.models_dir = models_dir
        self.autoload = autoload
        self.models_max = models_max
        self.unload_timeout_s = unload_timeout_s
        self.engine_process = engine_process
        self.process_setup = process_setup
        self.read_memory = read_memory
        self.hosts: dict[str, ModelHost] = {}
        self.startup_names: list[str] = []
        self.startup_done = asyncio.Event()
        self.startup_error: str | None = None
        self._loads: dict[str, asyncio.Future[ModelHost]] = {}  # on-demand loads in progress
        self._claimed: set[str] = set()  # names being loaded, not registered yet
        self._from_dir: set[str] = set()  # loaded from --models-dir: a request reloads them
        self._retired: dict[str, EngineTotals] = {}  # counters of unloaded models, by name
        self._idle_watch: asyncio.Task[None] | None = None

    # ---- what is served ---------------------------------------------------------------------

    def add(self, launch: ModelLaunch, startup: bool = True) -> ModelHost:
        """Registers a model (not loaded yet); start-up models load in :meth:`start`."""
        listener: OutputListener | None = None
        if self.on_outputs is not None:
            observe, name = self.on_outputs, launch.name
            listener = lambda outputs: observe(name, outputs)  # noqa: E731
        host = ModelHost(
            launch,
            listener,
            engine_process=self.engine_process,
            process_setup=self.process_setup,
            retired=self._retired.pop(launch.name, EngineTotals()),
        )
        self.hosts[launch.name] = host
        if startup:
            self.startup_names.append(launch.name)
        return host

    @property
    def default_name(self) -> str | None:
        """The model a request without ``model`` gets: the first start-up model still served,
        else the only model loaded."""
        for name in self.startup_names:
            if name in self.hosts:
                return name
        return next(iter(self.hosts)) if len(self.hosts) == 1 else None

    def available(self) -> dict[str, Path]:
        """Models of ``--models-dir`` by name (read again on every call: files come and go)."""
        return scan_models_dir(self.models_dir) if self.models_dir else {}

    def host(self, requested: str | None) -> ModelHost:
        """A registered model by name (None: the default one), or ``ModelNotFoundError``."""
        name = requested or self.default_name
        host = self.hosts.get(name) if name else None
        if host is None:
            raise self.not_found(requested)
        return host

    def not_found(self, requested: str | None) -> ModelNotFoundError:
        loaded = ", ".join(f"'{n}'" for n in self.hosts) or "none"
        message = (
            f"The model '{requested}' does not exist or is not loaded"
            if requested
            else "No model was named and this server has no default model"
        )
        message += f"; loaded models: {loaded}"
        loadable = sorted(set(self.available()) - set(self.hosts))
        if loadable:
            how = "" if self.autoload else " (POST /models/load)"
            message += f"; available to load{how}: {', '.join(loadable)}"
        return ModelNotFoundError(message + ".")

    async def acquire(self, requested: str | None, keep_alive_s: float | None = None) -> ModelHost:
        """The ready model a request names (loading it first from the models dir when it is
        not loaded and autoload is on; concurrent requests share one load), or 404 / 503."""
        name = requested or self.default_name
        host = self.hosts.get(name) if name else None
        try:
            if name and name in self._loads:
                host = await asyncio.shield(self._loads[name])
            elif host is None and name in self._claimed:  # POST /models/load is at work on it
                raise ModelUnavailableError(f"The model {name} is loading; retry shortly.", 5)
            elif host is None and name and self.autoload and name in self.available():
                host = await asyncio.shield(self._load_on_demand(name))
        except ModelLoadError as exc:
            if exc.status == 409:  # --models-max reached and every model busy: not the client's
                raise ModelUnavailableError(f"{exc} Retry shortly.", 5) from exc
            raise
        if host is None:
            raise self.not_found(requested)
        host.require_ready()  # 503 while loading, unhealthy, unloading or draining
        host.last_used = time.monotonic()
        if keep_alive_s is not None and self._reloadable(host.name):
            host.keep_alive_s = keep_alive_s if keep_alive_s >= 0 else None
        return host

    def _reloadable(self, name: str) -> bool:
        """Only a model the next request can load again obeys a request's ``keep_alive``:
        a client must not be able to take away a start-up model, or one loaded by path."""
        return self.autoload and name in self._from_dir

    # ---- loading and unloading --------------------------------------------------------------

    async def start(self) -> None:
        """Loads the start-up models in order; the server exits if one fails."""
        self._idle_watch = asyncio.ensure_future(self._unload_idle())
        try:
            for name in list(self.startup_names):
                host = self.hosts[name]
                await host.load()
                if host.load_error is not None:
                    self.startup_error = f"{name}: {host.load_error}"
                    break
        finally:
            self.startup_done.set()

    def _load_on_demand(self, name: str) -> asyncio.Future[ModelHost]:
        future = self._loads[name] = asyncio.ensure_future(self.load(name))

        def done(finished: asyncio.Future[ModelHost]) -> None:
            self._loads.pop(name, None)
            if not finished.cancelled():
                finished.exception()  # retrieved: the waiting requests report it (or left)

        future.add_done_callback(done)
        return future

    async def load(
        self, name: str, path: Path | None = None, options: Mapping[str, Any] | None = None
    ) -> ModelHost:
        """Loads one model and returns it ready, or raises :class:`ModelLoadError`."""
        existing = self.hosts.get(name)
        if existing is not None or name in self._claimed:
            state = existing.state.value if existing is not None else "loading"
            raise ModelLoadError(409, f"The name '{name}' is taken: that model is {state}.")
        self._claimed.add(name)
        try:
            return await self._load(name, path, options or {})
        finally:
            self._claimed.discard(name)

    async def _load(self, name: str, path: Path | None, options: Mapping[str, Any]) -> ModelHost:
        if self.make_launch is None:
            raise ModelLoadError(400, "This server cannot load models at run time.")
        from_dir = path is None
        if path is None:
            path = self.available().get(name)
            if path is None:
                raise ModelLoadError(404, str(self.not_found(name)))
        try:
            # Reads the model's metadata for the pre-flight: off the event loop.
            launch = await asyncio.to_thread(self.make_launch, name, path, options)
        except Exception as exc:  # bad options, an unreadable or unsupported model
            raise ModelLoadError(400, f"Cannot load '{name}': {exc}") from exc
        self._preflight(launch)
        await self._make_room(name)
        host = self.add(launch, startup=False)
        await host.load()
        if host.load_error is not None:
            self.hosts.pop(name, None)
            self._retired[name] = host.retired
            raise ModelLoadError(500, f"Loading '{name}' failed: {host.load_error}.")
        if from_dir:
            self._from_dir.add(name)
        return host

    def _preflight(self, launch: ModelLaunch) -> None:
        """Refuses a model whose estimate does not fit in what is left, before loading it."""
        need = launch.memory
        if need is None:
            return
        if need.device_bytes:
            free = free_gpu_bytes()
            if free is not None and need.device_bytes > free:
                raise ModelLoadError(400, _too_big(launch.name, need, free))
        if not need.host_bytes:
            return
        reading = self.read_memory()
        # Weights are memory-mapped: the kernel counts their pages as reclaimable cache, so
        # what the loaded models were estimated to take is subtracted from the total as well.
        held = sum(h.launch.memory.host_bytes for h in self.hosts.values() if h.launch.memory)
        free = min(reading.available_bytes, reading.total_bytes - held)
        if need.host_bytes + PREFLIGHT_HEADROOM_BYTES > free:
            raise ModelLoadError(400, _too_big(launch.name, need, free))

    async def _make_room(self, name: str) -> None:
        """At ``--models-max``, unloads the least recently used idle model."""
        active = [h for h in self.hosts.values() if h.state in _ACTIVE]
        # Other loads still preparing count too, or two at once could both pass the limit.
        preparing = {n for n in self._claimed if n not in self.hosts} - {name}
        if self.models_max <= 0 or len(active) + len(preparing) < self.models_max:
            return
        idle = [h for h in active if h.num_in_flight == 0 and h.state is not ModelState.LOADING]
        if not idle:
            raise ModelLoadError(
                409,
                f"Cannot load '{name}': {len(active)} models are loaded (--models-max "
                f"{self.models_max}) and every one is serving requests or loading.",
            )
        victim = min(idle, key=lambda h: h.last_used)
        logger.info("unloading %s (least recently used) to make room for %s", victim.name, name)
        await self.unload(victim.name)

    async def unload(self, name: str, force: bool = False, timeout_s: float | None = None) -> int:
        """Unloads a model (see ``ModelHost.unload``); returns how many requests were cut."""
        host = self.hosts.get(name)
        if host is None or host.state is ModelState.UNLOADING:
            raise self.not_found(name)
        wait_s = self.unload_timeout_s if timeout_s is None else timeout_s
        cut_off = await host.unload(wait_s, force)
        if self.hosts.get(name) is host:
            del self.hosts[name]
            self._from_dir.discard(name)
        self._retired[name] = host.retired
        logger.info("model %s unloaded (%d requests cut off)", name, cut_off)
        return cut_off

    async def _unload_idle(self) -> None:
        """Unloads models idle past their ``keep_alive``."""
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now = time.monotonic()
            for host in list(self.hosts.values()):
                if host.keep_alive_s is None or host.state not in _ACTIVE[1:]:
                    continue
                if host.num_in_flight:
                    host.last_used = now  # idle time counts from the last request's end
                elif now - host.last_used >= host.keep_alive_s:
                    logger.info("model %s idle past its keep_alive: unloading", host.name)
                    with contextlib.suppress(ModelNotFoundError):
                        await self.unload(host.name)

    # ---- the whole server -------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return sum(h.num_in_flight for h in self.hosts.values())

    async def drain(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> int:
        """Every model drains at once (see ``ModelHost.drain``); returns how many aborted."""
        for future in list(self._loads.values()):
            future.cancel()
        hosts = list(self.hosts.values())
        return sum(await asyncio.gather(*(h.drain(timeout_s, cut_short) for h in hosts)))

    async def stop(self) -> None:
        if self._idle_watch is not None:
            self._idle_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_watch
        for future in list(self._loads.values()):
            future.cancel()
        await asyncio.gather(*(h.stop() for h in list(self.hosts.values())))


def _too_big(name: str, need: MemoryNeed, free: int) -> str:
    return (
        f"Cannot load '{name}': it needs about {need.describe()}, and about "
        f"{max(free, 0) / 2**30:.2f} GiB is free. Lower ctx_size, slots or max_model_len, or "
        "unload a model first."
    )
