"""Running the HTTP server with a graceful shutdown.

On the first SIGTERM or SIGINT the server stops admitting work (generation requests and
readiness get 503), lets in-flight requests finish for up to ``--shutdown-timeout`` seconds,
aborts what is left (each stream ends with ``finish_reason: "abort"``), then closes the
listener and exits with status 0. A second signal skips the wait (the aborted streams still
end properly); a third exits at once.

uvicorn's own handling would stop listening at once (new clients see a refused connection,
not a 503) and re-raise the signal after shutting down, so the process would end by the
signal instead of exiting 0: this subclass takes the signals over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from slotserve.hosting.registry import ModelRegistry

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, models: ModelRegistry, shutdown_timeout_s: float):
        super().__init__(config)
        self._models = models
        self._shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Future[None] | None = None
        self._skip_wait = asyncio.Event()

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(self._exit_if_a_model_never_loads())
        try:
            await super().serve(sockets)  # type: ignore[arg-type]
        finally:
            watcher.cancel()

    async def _exit_if_a_model_never_loads(self) -> None:
        # A server whose start-up model cannot load is misconfigured: exit (status 1) rather
        # than answer 503 forever. A failed *reload* keeps serving health and reload.
        await self._models.startup_done.wait()
        if self._models.startup_error is not None:
            logger.error("the model failed to load (%s); exiting", self._models.startup_error)
            self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._skip_wait.is_set():  # a third signal: leave at once
            logger.warning("exiting without waiting for requests")
            self.should_exit = self.force_exit = True
            return
        if self._draining is not None:
            # The second signal skips the wait: in-flight requests are aborted now, their
            # streams still end with finish_reason "abort" and [DONE].
            logger.warning("second signal: aborting requests in flight")
            self._loop.call_soon_threadsafe(self._skip_wait.set)
            return
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        in_flight = self._models.num_in_flight
        logger.info(
            "%s: no longer admitting requests; waiting up to %.0f s for %d in flight",
            signal_name,
            self._shutdown_timeout_s,
            in_flight,
        )
        try:
            aborted = await self._models.drain(self._shutdown_timeout_s, self._skip_wait)
            logger.info(
                "drained: %d requests finished, %d aborted", max(0, in_flight - aborted), aborted
            )
        finally:
            self.should_exit = True
