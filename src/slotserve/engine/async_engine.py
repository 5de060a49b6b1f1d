"""Bridge between asyncio request handlers and the engine thread (SPEC E3, E7, E11).

Handlers call :meth:`AsyncEngine.generate`, an async iterator over :class:`RequestOutput`.
The engine thread hands each step's outputs to the event loop in one ``call_soon_threadsafe``
and the loop routes them into per-request ``asyncio.Queue``s. Leaving the iterator early
(client disconnect, cancellation) aborts the request, which frees its slot in the next step.

When the runner fails, the engine is poisoned: every request in it gets an error output and
the engine thread ends. :attr:`AsyncEngine.unhealthy` then says why; a new runner and engine
(the server's reload) recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Callable

from slotserve.engine.engine_core import EngineCore
from slotserve.engine.errors import EngineDeadError
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputListener = Callable[[list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, core: EngineCore, on_outputs: OutputListener | None = None) -> None:
        """``on_outputs`` sees every step's outputs on the event loop (metrics)."""
        self.core = core
        self._on_outputs = on_outputs
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: str | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.unhealthy is None

    @property
    def unhealthy(self) -> str | None:
        """Why the engine stopped serving (runner failure, loop crash); None while healthy."""
        return self.core.unhealthy or self._dead

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose streams are still open."""
        return len(self._queues)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    def start(self) -> None:
        """Starts the engine thread; must be called from the event loop that will consume."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slotserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def launch(
        cls, build: Callable[[], EngineCore], on_outputs: OutputListener | None = None
    ) -> AsyncEngine:
        """Starts an engine thread that first builds its core (loads the model) and then runs
        it; returns once the core is built, or raises what ``build`` raised.

        NOTE: the runner is loaded on the thread that will run it. PyTorch's OpenMP keeps a
        worker team per calling thread, and libgomp shortens its workers' spin-wait when
        more threads are managed than there are cores: a model loaded on another thread
        left a second team behind and made every forward pass ~40% slower (measured, 2
        cores).
        """
        loop = asyncio.get_running_loop()
        built: asyncio.Future[AsyncEngine] = loop.create_future()

        def settle(result: AsyncEngine | BaseException) -> None:
            if built.done():  # the caller gave up waiting (shutdown during the load)
                if isinstance(result, AsyncEngine):
                    result.core.stop()
                return
            if isinstance(result, BaseException):
                built.set_exception(result)
            else:
                built.set_result(result)

        def run() -> None:
            try:
                engine = cls(build(), on_outputs)
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle, exc)
                return
            engine._loop = loop
            engine._thread = threading.current_thread()
            loop.call_soon_threadsafe(settle, engine)
            engine._run()

        threading.Thread(target=run, name="slotserve-engine", daemon=True).start()
        return await built

    async def shutdown(self) -> None:
        """Stops the engine thread and closes the runner. Requests still in the engine end
        with an error output (their streams close), so no caller waits forever."""
        self.core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # The engine thread is gone, so the loop may touch the core.
        self._route(self.core.fail_all("the engine was stopped (shutdown or reload)"))
        self.core.runner.close()

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Validates and queues a request; returns the stream of its outputs.

        Raises ``InvalidRequestError``, ``QueueFullError`` or ``EngineDeadError`` at once. Use
        the stream as a context manager: leaving it before the request finished aborts it.
        """
        unhealthy = self.unhealthy
        if unhealthy is not None:
            raise EngineDeadError(unhealthy)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id} is already in flight")
        request = self.core.make_request(request_id, prompt_token_ids, params)
        self.core.add_request(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return RequestStream(self, request_id, queue)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submits a request and yields its outputs until it finishes (aborts if left early)."""
        with self.submit(request_id, prompt_token_ids, params) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    def abort_all(self) -> int:
        """Aborts every request in flight (shutdown); each still gets its final output."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self.core.abort_request(request_id)
        return len(request_ids)

    def detach(self, request_id: str) -> None:
        """Stops routing outputs of ``request_id`` (its stream was closed)."""
        self._queues.pop(request_id, None)

    def _run(self) -> None:
        core = self.core
        try:
            while core.wait_for_work():
                outputs = core.step()
                if outputs:
                    self._deliver(outputs)
                if core.unhealthy is not None:
                    return  # poisoned: every request has its error; nothing more to run
                if core.is_idle:
                    core.check_integrity_when_idle()
        except Exception as exc:
            logger.exception("engine loop crashed")
            self._dead = f"engine loop crashed: {exc}"
            self._deliver(core.fail_all(self._dead))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self._route, outputs)

    def _route(self, outputs: list[RequestOutput]) -> None:
        if self._on_outputs is not None:
            try:
                self._on_outputs(outputs)
            except Exception:  # metrics must never lose a request's output
                logger.exception("output listener failed")
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)


class RequestStream:
    """Outputs of one request, in step order; the last one has ``finished`` set."""

    def __init__(
        self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        self.finished = output.finished
        return output

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def abort(self) -> None:
        """Asks the engine to end the request; its final output still arrives on the stream."""
        if not self.finished:
            self._engine.abort(self.request_id)

    def close(self) -> None:
        """Stops listening; aborts the request if it has not finished."""
        self._engine.detach(self.request_id)
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
