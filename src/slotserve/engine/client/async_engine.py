"""The engine as asyncio request handlers see it.

Handlers call :meth:`AsyncEngine.generate` (or :meth:`AsyncEngine.submit`), an async iterator
over :class:`RequestOutput`. The core client (``base.EngineCoreClient``) hands each step's
outputs to the event loop in one ``call_soon_threadsafe`` and the loop routes them into
per-request ``asyncio.Queue``s. Leaving the iterator early (client disconnect, cancellation)
aborts the request, which frees its slot in the next step.

When the runner fails, the engine is poisoned: every request in it gets an error output and
the engine thread ends. :attr:`AsyncEngine.unhealthy` then says why; a new runner and engine
(the server's reload) recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable

import msgspec

from slotserve.engine.client.base import Deliver, EngineCoreClient
from slotserve.engine.client.inproc_client import InprocClient
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.stats import EngineStats
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError
from slotserve.engine.outputs import STOPPED_REASON, RequestOutput
from slotserve.engine.runner_interface import AdapterInfo, ModelInfo, Tokenizer

logger = logging.getLogger(__name__)

OutputListener = Callable[[list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, on_outputs: OutputListener | None = None) -> None:
        """``on_outputs`` sees every step's outputs on the event loop (metrics)."""
        self._on_outputs = on_outputs
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        # Ids the engine still holds: a stream closed early leaves its request in the engine
        # until the abort's final output comes back.
        self._busy: set[str] = set()
        self._loop = asyncio.get_running_loop()
        self._client: EngineCoreClient | None = None

    @classmethod
    async def launch(
        cls, build: Callable[[], EngineCore], on_outputs: OutputListener | None = None
    ) -> AsyncEngine:
        """Builds the core on its own engine thread (see ``InprocClient.launch``) and starts
        serving; raises what ``build`` raised."""
        return await cls.connect(lambda deliver: InprocClient.launch(build, deliver), on_outputs)

    @classmethod
    async def connect(
        cls,
        start: Callable[[Deliver], Awaitable[EngineCoreClient]],
        on_outputs: OutputListener | None = None,
    ) -> AsyncEngine:
        """Serves through the core client ``start`` returns (an engine thread or process);
        ``start`` gets the callback that takes every step's outputs."""
        engine = cls(on_outputs)
        engine._client = await start(engine._deliver)
        return engine

    @property
    def client(self) -> EngineCoreClient:
        assert self._client is not None, "the engine was not launched"
        return self._client

    @property
    def config(self) -> EngineConfig:
        return self.client.config

    @property
    def model_info(self) -> ModelInfo:
        return self.client.model_info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.client.tokenizer

    @property
    def stats(self) -> EngineStats:
        """What the core last published (never blocks it)."""
        return self.client.stats

    @property
    def forward_seconds(self) -> float:
        return self.client.forward_seconds

    @property
    def unhealthy(self) -> str | None:
        """Why the engine stopped serving (runner failure, loop crash); None while healthy."""
        return self.client.unhealthy

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose streams are still open."""
        return len(self._queues)

    def has_request(self, request_id: str) -> bool:
        """True while the engine holds a request with this id."""
        return request_id in self._busy

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stops the engine and closes the runner; requests still in it end with an error
        output saying ``reason`` (their streams close), so no caller waits forever."""
        await self.client.shutdown(reason)

    def submit(self, request: EngineCoreRequest) -> RequestStream:
        """Validates and queues a request; returns the stream of its outputs.

        Raises ``InvalidRequestError``, ``QueueFullError`` or ``EngineDeadError`` at once. An
        id the engine still holds gets a suffix (clients may reuse ``x-request-id``): the
        stream's ``request_id`` is the one the engine uses. Use the stream as a context
        manager: leaving it before the request finished aborts it.
        """
        unhealthy = self.unhealthy
        if unhealthy is not None:
            raise EngineDeadError(unhealthy)
        request_id = request.request_id
        while request_id in self._busy:
            request_id = f"{request_id.split('~')[0]}~{uuid.uuid4().hex[:8]}"
        if request_id != request.request_id:
            request = msgspec.structs.replace(request, request_id=request_id)
        self.client.add_request(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        self._busy.add(request_id)
        return RequestStream(self, request_id, queue)

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submits a request and yields its outputs until it finishes (aborts if left early)."""
        with self.submit(request) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def abort_all(self) -> int:
        """Aborts every request in flight (shutdown); each still gets its final output."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self.client.abort(request_id)
        return len(request_ids)

    async def flush_prefix_cache(self) -> int:
        """Evicts every cached prefix no running request uses; returns the tokens freed once
        :attr:`stats` shows it (``EngineDeadError`` when the engine no longer serves)."""
        return await self.client.flush_prefix_cache()

    async def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        """Loads the LoRA adapter at ``path`` as ``name``, or with no path unloads ``name``
        (its requests in flight end with an error), between two steps."""
        return await self.client.call_adapter(name, path)

    def detach(self, request_id: str) -> None:
        """Stops routing outputs of ``request_id`` (its stream was closed)."""
        self._queues.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Any thread: routes the outputs on the event loop."""
        if _running_loop() is self._loop:
            self._route(outputs)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self._route, outputs)

    def _route(self, outputs: list[RequestOutput]) -> None:
        if self._on_outputs is not None:
            try:
                self._on_outputs(outputs)
            except Exception:  # metrics must never lose a request's output
                logger.exception("output listener failed")
        for output in outputs:
            if output.finished:
                self._busy.discard(output.request_id)
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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
