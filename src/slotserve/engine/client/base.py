"""What the serving side calls, wherever the engine core runs (:class:`EngineCoreClient`), and
what both clients share (:class:`ClientState`): the published snapshot, a request's validation
on the caller's thread, the answer a caller awaits from another thread, and the two refusals
(queue full, engine not serving).

The 429 decision reads what the core published with what is still in transit to it, under the
client's lock: ``waiting = not yet counted by the core + published waiting``; one step stale at
worst, and then too high (it errs towards refusing), never too low.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.limits import validate_request
from slotserve.engine.core.stats import EngineStats
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError, QueueFullError
from slotserve.engine.outputs import STOPPED_REASON, RequestOutput
from slotserve.engine.runner_interface import AdapterInfo, ModelInfo, Tokenizer

Deliver = Callable[[list[RequestOutput]], None]  # called on the engine (or receiving) thread
# Answers one awaiting caller from any thread: a result, or the exception to raise.
Settle = Callable[[Any], None]


def answer() -> tuple[asyncio.Future[Any], Settle]:
    """A future for the calling coroutine and the function any thread settles it with."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def resolve(result: Any) -> None:
        if future.done():  # the caller was cancelled
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def settle(result: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
            loop.call_soon_threadsafe(resolve, result)

    return future, settle


class ClientState:
    """What both clients keep on the serving side: the model's description, the snapshot the
    core last published, why it stopped serving, and the lock that guards them. Subclasses
    take the lock around every change."""

    def __init__(
        self,
        config: EngineConfig,
        model_info: ModelInfo,
        tokenizer: Tokenizer,
        published: EngineStats,
        deliver: Deliver,
    ) -> None:
        self.config = config
        self.model_info = model_info
        self.tokenizer = tokenizer
        self._deliver = deliver
        self._lock = threading.Lock()
        self._published = published
        self._stopping = False
        self._dead: str | None = None  # the engine's loop or process died

    @property
    def stats(self) -> EngineStats:
        """The snapshot the core published after its last step."""
        return self._published

    @property
    def unhealthy(self) -> str | None:
        """Why the engine stopped serving (runner failure, crash); None while healthy."""
        return self._published.unhealthy or self._dead

    def _validate(self, request: EngineCoreRequest) -> None:
        """On the caller's thread, so that a request the model cannot serve is the caller's
        400 before anything is queued (``InvalidRequestError``)."""
        validate_request(self, self.config, request)

    def _refuse_unless_serving(self) -> None:
        """Under the lock: new work (a request, a cache flush) is refused once the engine
        failed or is stopping."""
        if self.unhealthy is not None or self._stopping:
            raise EngineDeadError(self.unhealthy or "the engine is stopping")

    def _refuse_when_full(self, in_transit: int) -> None:
        """Under the lock, the 429 decision: requests the core has not yet counted in a
        published snapshot (``in_transit``) plus those it last published as waiting, less the
        free slots that will take some of them, against ``max_queue``. Stale by a step at
        worst, and then too high."""
        published = self._published
        if in_transit + published.num_waiting - published.num_free_slots >= self.config.max_queue:
            raise QueueFullError(self.config.max_queue)


class EngineCoreClient(Protocol):
    """The engine core as the serving side's event loop sees it, wherever it runs."""

    config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer

    @property
    def stats(self) -> EngineStats:
        """What the core published after its last step (never blocks it)."""
        ...

    @property
    def unhealthy(self) -> str | None:
        """Why the engine stopped serving; None while healthy."""
        ...

    @property
    def forward_seconds(self) -> float: ...

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validates a request against the model (``InvalidRequestError``) and queues it
        (``QueueFullError``, 429, or ``EngineDeadError``), all at once."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def flush_prefix_cache(self) -> int:
        """Evicts every cached prefix no running sequence uses, between two steps; returns the
        tokens freed once the core has published a snapshot that shows it
        (``EngineDeadError`` when the engine no longer serves)."""
        ...

    async def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        """Loads the LoRA adapter at ``path`` as ``name`` (None: unloads ``name``) between two
        steps: ``InvalidRequestError``, ``AdapterNotFoundError`` or ``EngineDeadError``."""
        ...

    def stop(self) -> None: ...

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stops the core; requests still in it end with an error output saying ``reason``."""
        ...
