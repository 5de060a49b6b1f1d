"""Running one HTTP request's prompts through the engine: submitting them, merging their
outputs, noticing a client that left, and counting tokens. The chat pipeline
(``pipeline.py``) and the text completion route build on :class:`EngineRun`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from slotserve.engine.client.async_engine import AsyncEngine, RequestStream
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.outputs import RequestOutput, SampledToken, SequenceDelta
from slotserve.server.errors import GenerationFailed
from slotserve.server.events import Usage
from slotserve.server.tracing import note_submitted


def with_engine_ids(request_id: str, prompts: list[list[int]]) -> list[tuple[str, list[int]]]:
    """Each prompt of one HTTP request with its engine request id: ``request_id`` for a lone
    prompt, else ``<request_id>-0``, ``<request_id>-1``, ..."""
    if len(prompts) == 1:
        return [(request_id, prompts[0])]
    return [(f"{request_id}-{k}", prompt) for k, prompt in enumerate(prompts)]


def submit_prompts(engine: AsyncEngine, requests: list[EngineCoreRequest]) -> list[RequestStream]:
    """Submits the engine requests of one HTTP request (one per prompt); raises (4xx errors)
    before anything is queued for a request that fails validation, and withdraws the ones
    already queued."""
    streams: list[RequestStream] = []
    try:
        for request in requests:
            streams.append(engine.submit(request))
            note_submitted(streams[-1].request_id)
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


def abort_all(streams: list[RequestStream]) -> Callable[[], None]:
    def abort() -> None:
        for stream in streams:
            stream.abort()

    return abort


async def merge_outputs(
    streams: list[RequestStream],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yields ``(prompt_index, output)`` until every stream finished; leaving early aborts all."""
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            async for output in stream:
                merged.put_nowait((index, output))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                index, output = await merged.get()
                remaining -= output.finished
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for stream in streams:
            stream.close()


@contextlib.asynccontextmanager
async def abort_on_disconnect(
    raw_request: Request, abort: Callable[[], None]
) -> AsyncIterator[asyncio.Event]:
    """Watches the connection while the body of the ``with`` runs; on disconnect calls
    ``abort`` (the engine then ends the request within one step) and sets the yielded event."""
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                abort()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        yield gone
    finally:
        watcher.cancel()


class EngineRun:
    """The engine requests of one HTTP request (one per prompt, ``n`` sequences each), run to
    the end once through :meth:`deltas`."""

    def __init__(
        self, engine: AsyncEngine, raw: Request, streams: list[RequestStream], n: int
    ) -> None:
        self._engine = engine
        self._raw = raw
        self._streams = streams
        self._n = n
        self._prompt = [0] * len(streams)
        self._cached = [0] * len(streams)
        self._completion = [0] * len(streams)
        self.disconnected = False  # the client left, and the requests were aborted

    @property
    def num_choices(self) -> int:
        return len(self._streams) * self._n

    async def deltas(self) -> AsyncGenerator[tuple[int, SequenceDelta], None]:
        """``(choice, delta)`` in the order the engine made them; choice ``k * n + i`` is
        sequence ``i`` of prompt ``k``. ``GenerationFailed`` when the engine ended the
        requests early (an error or the time limit); a client disconnect aborts them."""
        streams = self._streams
        async with (
            abort_on_disconnect(self._raw, abort_all(streams)) as gone,
            contextlib.aclosing(merge_outputs(streams)) as outputs,
        ):
            async for k, output in outputs:
                if output.failure is not None:
                    raise GenerationFailed(output, self._engine.config.request_timeout_s)
                for delta in output.deltas:
                    yield k * self._n + delta.index, delta
                self._prompt[k] = output.num_prompt_tokens
                self._cached[k] = output.num_cached_tokens
                self._completion[k] = output.num_output_tokens
        self.disconnected = gone.is_set()

    def usage(self) -> Usage:
        """Token counts summed over the prompts, as OpenAI's usage reports them."""
        return Usage(sum(self._prompt), sum(self._completion), sum(self._cached))


@dataclass
class ChoiceAccumulator:
    """Everything one choice produced, for non-streaming answers."""

    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[SampledToken] | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.text.append(delta.text)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


async def accumulate(run: EngineRun) -> list[ChoiceAccumulator]:
    """Runs to the end; one accumulator per choice."""
    choices = [ChoiceAccumulator() for _ in range(run.num_choices)]
    async with contextlib.aclosing(run.deltas()) as deltas:
        async for index, delta in deltas:
            choices[index].add(delta)
    return choices
