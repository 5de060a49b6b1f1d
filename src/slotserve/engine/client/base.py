"""What the serving side calls, wherever the engine core runs (:class:`EngineCoreClient`), and
the pieces both clients share: the answer a caller awaits from another thread and the two
refusals (queue full, engine not serving).

The 429 decision (:func:`refuse_when_full`) reads what the core published with what is still
in transit to it, under the client's lock: ``waiting = not yet counted by the core + published
waiting``; one step stale at worst, and then too high (it errs towards refusing), never too
low.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.stats import EngineStats
from slotserve.engine.errors import EngineDeadError, QueueFullError
from slotserve.engine.outputs import STOPPED_REASON, RequestOutput
from slotserve.engine.request import Request
from slotserve.engine.runner_interface import ModelInfo, Tokenizer
from slotserve.engine.sampling_params import SamplingParams

Deliver = Callable[[list[RequestOutput]], None]  # called on the engine (or receiving) thread
# Answers one awaiting caller from any thread: a result, or the exception to raise.
Settle = Callable[[int | BaseException], None]


def answer() -> tuple[asyncio.Future[int], Settle]:
    """A future for the calling coroutine and the function any thread settles it with."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def resolve(result: int | BaseException) -> None:
        if future.done():  # the caller was cancelled
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def settle(result: int | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
            loop.call_soon_threadsafe(resolve, result)

    return future, settle


def refuse_when_full(in_transit: int, published: EngineStats, max_queue: int) -> None:
    """The 429 decision: requests the core has not yet counted in a published
    snapshot plus those it last published as waiting, less the free slots that will take
    some of them, against ``--max-queue``. Stale by a step at worst, and then too high."""
    if in_transit + published.num_waiting - published.num_free_slots >= max_queue:
        raise QueueFullError(max_queue)


def refuse_unless_serving(unhealthy: str | None, stopping: bool) -> None:
    """New work (a request, a cache flush) is refused once the engine failed or is stopping."""
    if unhealthy is not None or stopping:
        raise EngineDeadError(unhealthy or "the engine is stopping")


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

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validates a request against the model (``InvalidRequestError``)."""
        ...

    def add_request(self, request: Request) -> None:
        """Queues a request: ``QueueFullError`` (429) or ``EngineDeadError`` at once."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def flush_prefix_cache(self) -> int:
        """Evicts every cached prefix no running sequence uses, between two steps; returns the
        tokens freed once the core has published a snapshot that shows it
        (``EngineDeadError`` when the engine no longer serves)."""
        ...

    def stop(self) -> None: ...

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stops the core; requests still in it end with an error output saying ``reason``."""
        ...
