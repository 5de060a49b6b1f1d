"""One served model's life cycle: loading in the background, serving, restarting its engine
when it dies (or unhealthy until a reload), reloading, unloading, draining at shutdown. What a
served model is made of, its states and the errors a caller gets: ``served.py``.

::

    loading ──▶ ready ──engine died──▶ loading (restart, after a backoff) ──▶ ready
       │          │    └─ --engine-restart never ─▶ unhealthy ──reload──▶ loading
       │          └──────────────────── reload ─────────────────────────────▲
       ▼
     failed (load error, or a crash loop; reload retries)
    any ──unload──▶ unloading ──▶ (gone)       any ──SIGTERM──▶ draining ──▶ stopped

An engine dies when its process does (killed, segfault, out of memory) or when its runner
fails (an exception or non-finite logits poison it). Either way the requests in it end with an
error; a restart builds a new runner and engine as a reload does. ``RestartPolicy.limit``
deaths within its window are a crash loop: the model is then left failed, with the reason.

The HTTP server listens from the start: while the model loads, readiness fails and generation
requests get a 503 that says so. A reload builds a new runner and a new engine; requests still
in the old engine end first (their streams get an error). The models of a server, and which
of them are loaded, are the registry's (``registry.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from slotserve.engine.client.async_engine import OutputListener
from slotserve.engine.core.stats import EngineTotals
from slotserve.engine.errors import EngineDeadError
from slotserve.engine.outputs import STOPPED_REASON
from slotserve.hosting.preparation import prepared
from slotserve.hosting.served import (
    LOADING_RETRY_AFTER_S,
    RELOAD_HINT,
    LoadedModel,
    ModelLaunch,
    ModelState,
    ModelUnavailableError,
    ReloadConflictError,
    build_model,
)

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1  # how often a host looks at its engine's health

_P = ParamSpec("_P")
_T = TypeVar("_T")

LEASE_WAIT_S = 60.0  # how long retiring an engine waits for work that still uses its tokenizer


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
    restarts: int = 0  # engines rebuilt after a death, not counting reloads
    # Counters of engines reloaded away (and of this name's earlier loads, after an unload).
    retired: EngineTotals = field(default_factory=EngineTotals)
    last_used: float = field(default_factory=time.monotonic)  # for --models-max's LRU
    keep_alive_s: float | None = None  # Ollama's keep_alive: unload when idle this long
    _loading: bool = False
    _unloading: bool = False
    _draining: bool = False
    _stopped: bool = False
    _load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The engine's recent deaths (monotonic times), and why a restart is under way.
    _deaths: deque[float] = field(default_factory=deque)
    _started_at: float = 0.0  # when the engine serving now became ready (monotonic)
    _quick_deaths: int = 0  # deaths in a row, each soon after the engine's start
    _restarting: str | None = None
    _crash_loop: bool = False  # load_error then says why the restarts stopped
    _watcher: asyncio.Task[None] | None = None
    _leases: Counter[int] = field(default_factory=Counter)  # id(LoadedModel) → jobs using it

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
        if self._loading or self._restarting is not None:
            return ModelState.LOADING
        if self.model is None:
            return ModelState.FAILED if self.load_error else ModelState.LOADING
        if self.model.engine.unhealthy is not None:
            # The watcher restarts a dead engine: from its death on, the model is loading.
            return ModelState.LOADING if self._watching else ModelState.UNHEALTHY
        return ModelState.READY

    @property
    def _watching(self) -> bool:
        return self._watcher is not None and not self._watcher.done()

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
            if self._crash_loop:
                return str(self.load_error)
            return f"the model failed to load ({self.load_error})"
        if state is ModelState.LOADING:
            dead = self.model.engine.unhealthy if self.model is not None else None
            if self._restarting is None and dead is not None:
                return f"the engine died ({dead}) and is being restarted"
            return self._restarting or "the model is loading"
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
            raise ModelUnavailableError(
                f"{reason}; retry shortly.", retry_after_s=LOADING_RETRY_AFTER_S
            )
        if state is ModelState.UNLOADING:
            raise ModelUnavailableError(f"{reason}; load it again to use it (POST /models/load).")
        raise ModelUnavailableError(f"{reason}; no new requests are accepted.")

    async def off_loop(
        self,
        model: LoadedModel,
        large: bool,
        fn: Callable[_P, _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """Runs ``fn`` (tokenizing, rendering) on the preparation threads, those of large
        requests where ``large`` (the caller's judgement of its request's size). ``model`` is
        leased meanwhile: retiring it waits, so its tokenizer is not closed under ``fn``. The
        model may still be reloaded or unloaded by the time this returns: a caller that then
        submits gets the model again (:meth:`require_same`), with nothing awaited since."""
        self._leases[id(model)] += 1
        try:
            return await prepared(large, fn, *args, **kwargs)
        finally:
            self._leases[id(model)] -= 1
            if not self._leases[id(model)]:
                del self._leases[id(model)]

    def require_same(self, model: LoadedModel) -> LoadedModel:
        """``model`` if it still serves (after an await): else the 503 saying why, or that it
        was reloaded while the request was being prepared."""
        if self.require_ready() is not model:
            raise ModelUnavailableError(
                "the model was reloaded while this request was being prepared; retry it.",
                retry_after_s=1,
            )
        return model

    @contextlib.contextmanager
    def refusing_a_dead_engine(self) -> Iterator[None]:
        """Around a submission: an engine the submission finds dead, before this host has seen
        the death, is refused as :meth:`require_ready` refuses it from then on (a restart under
        way: a 503 with Retry-After), not with the dead engine's own error."""
        try:
            yield
        except EngineDeadError:
            self.require_ready()
            raise

    async def load(self, restart: bool = False) -> None:
        """Loads (or reloads) the model; on failure the state is FAILED with the reason. A
        load asked for (not a ``restart`` after a death) forgets earlier deaths."""
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
                self.model = await build_model(
                    self.launch, self.on_outputs, self.engine_process, self.process_setup
                )
                self.load_error = None
                self._crash_loop = False
                if not restart:
                    self._deaths.clear()
                    self._quick_deaths = 0
                self._started_at = time.monotonic()
                self.loads += 1
                self._watch()
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

    @property
    def _closing(self) -> bool:
        return self._draining or self._unloading or self._stopped

    def _watch(self) -> None:
        """Starts the watcher that restarts a dead engine, unless it runs or is not wanted."""
        if self.launch.restart.enabled and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch_engine(), name=f"watch-{self.name}")

    async def _watch_engine(self) -> None:
        """Restarts the engine whenever it dies, until a crash loop or the model's end."""
        while not self._closing:
            model = self.model
            if model is None or model.engine.unhealthy is None or self._loading:
                await asyncio.sleep(WATCH_INTERVAL_S)
                continue
            if not await self._restart(model, model.engine.unhealthy):
                return

    async def _restart(self, dead: LoadedModel | None, cause: str) -> bool:
        """Rebuilds a dead engine after the backoff, again while the rebuild itself fails;
        False once the deaths make a crash loop (the model is then failed)."""
        policy = self.launch.restart
        while True:
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > policy.window_s:
                self._deaths.popleft()
            deaths = len(self._deaths)
            if deaths >= policy.limit:
                await self._give_up(dead, cause, deaths)
                return False
            served_s = now - self._started_at if dead is not None else 0.0
            self._quick_deaths = policy.quick_deaths_after(self._quick_deaths, served_s)
            delay = policy.backoff_s(self._quick_deaths)
            logger.error(
                "model %s: %s; restarting its engine in %.1f s (death %d within %g s; "
                "death %d leaves the model failed)",
                self.name,
                cause,
                delay,
                deaths,
                policy.window_s,
                policy.limit,
            )
            self._restarting = f"the engine died ({cause}) and is being restarted"
            try:
                await asyncio.sleep(delay)
                if self._closing or self.model is not dead:
                    return True  # unloaded, stopped or reloaded meanwhile
                await self.load(restart=True)
            except ReloadConflictError:
                return True  # a reload asked for meanwhile has taken over
            finally:
                self._restarting = None
            if self.model is not None:
                self.restarts += 1
                return True
            dead, cause = None, f"restarting failed: {self.load_error}"

    async def _give_up(self, dead: LoadedModel | None, cause: str, deaths: int) -> None:
        if self.model is not dead:
            return  # a reload asked for meanwhile has taken over
        window = self.launch.restart.window_s
        message = (
            f"the engine died {deaths} times within {window:g} s and is not restarted "
            f"again (last: {cause})"
        )
        logger.error("model %s: %s; %s", self.name, message, RELOAD_HINT)
        self.model = None
        self.load_error, self._crash_loop = message, True
        if dead is not None:
            await self._retire(dead, message)

    async def _retire(self, model: LoadedModel, reason: str = STOPPED_REASON) -> None:
        """Stops an engine; whatever is still in it ends with an error saying ``reason``."""
        self.retired = self.retired.plus(model.stats, model.forward_seconds)
        deadline = time.monotonic() + LEASE_WAIT_S
        while self._leases[id(model)] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
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
        return self.retired.plus(model.stats, model.forward_seconds)

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
        self._stop_watching()
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
        self._stop_watching()
        async with self._load_lock:  # a load in progress finishes (or fails) first
            model, self.model = self.model, None
            if model is not None:
                how = "with force" if force else f"after waiting {timeout_s:g} s"
                await self._retire(model, f"the model {self.name} was unloaded ({how})")
        self._stopped = True
        return cut_off

    def _stop_watching(self) -> None:
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
