"""A chat prompt through the engine, as typed events.

:func:`submit_chat` submits a rendered prompt (the engine's request: prompt, sampling and the
rest) with its tool plan (``tool_plan.py``); :class:`ChatGeneration` then turns what the engine
makes into events (``events.py``): the reply split into thinking, text and tool calls
(``reply_parser.py``), each choice's finish, the usage. Every chat API runs here and differs
only in how it renders the events. The pipeline knows no API's request: a chat request becomes
an engine request and a plan in ``openai/chat_prompt.py``, which the Responses and Messages
APIs reach by translating their requests into a chat completion request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Protocol

from starlette.requests import Request

from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import LoadedModel
from slotserve.protocol.reasoning import ReasoningParser
from slotserve.server.events import ChoiceFinished, Event, PromptLogprobs, TokenLogprobs
from slotserve.server.generation import EngineRun, accumulate, submit_prompts
from slotserve.server.reply_parser import ReplyParser, parse_reply
from slotserve.server.tool_plan import ToolPlan


def finish_reason_of(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: ``tool_calls`` when the model ended on calls it chose to make (never with
    an empty list); a forced named function keeps ``stop``."""
    if has_calls and reason == "stop" and not plan.named:
        return "tool_calls"
    return reason


class EventFrames(Protocol):
    """An API's stream of one choice: the frames it sends first, then those of each event."""

    def opening(self) -> list[str]: ...

    def feed(self, event: Event) -> list[str]: ...


class ChatGeneration:
    """A submitted chat request; read its events once, through :meth:`stream` (one list per
    engine step and choice) or :meth:`collect` (the whole reply of every choice)."""

    def __init__(
        self,
        run: EngineRun,
        request_id: str,
        plan: ToolPlan,
        reasoning: ReasoningParser | None,
        num_prompt_tokens: int = 0,
    ) -> None:
        self._run = run
        self.request_id = request_id  # the engine's, and the chat completion's "id"
        self.plan = plan
        self.reasoning = reasoning
        self.num_choices = run.num_choices
        # Known at submission, before any output: what a stream may announce up front.
        self.num_prompt_tokens = num_prompt_tokens

    @property
    def disconnected(self) -> bool:
        """The client left and the request was aborted: nothing more should be sent."""
        return self._run.disconnected

    async def stream(self) -> AsyncGenerator[list[Event], None]:
        """The events of each engine step, one list per choice that produced something, and
        :class:`Usage` alone last unless the client left. ``GenerationFailed`` when the engine
        ended the request early."""
        parsers = [
            ReplyParser(i, self.plan.parser, self.reasoning) for i in range(self.num_choices)
        ]
        async with contextlib.aclosing(self._run.deltas()) as deltas:
            async for choice, delta in deltas:
                step: list[Event] = []
                if delta.prompt_logprobs is not None:
                    step.append(PromptLogprobs(choice, delta.prompt_logprobs))
                if delta.logprobs:
                    step.append(TokenLogprobs(choice, delta.logprobs))
                parser = parsers[choice]
                if delta.text:
                    step += parser.feed(delta.text)
                if delta.finish_reason is not None:
                    step += parser.finish()
                    reason, stop = delta.finish_reason, delta.stop_reason
                    step.append(self._finished(choice, reason, stop, parser.has_calls))
                if step:
                    yield step
        if not self._run.disconnected:
            yield [self._run.usage()]

    async def frames(self, render: EventFrames) -> AsyncGenerator[str, None]:
        """``render``'s frames of the whole run, its opening first; ``GenerationFailed`` when
        the engine ended the request early."""
        for frame in render.opening():
            yield frame
        async with contextlib.aclosing(self.stream()) as steps:
            async for step in steps:
                for event in step:
                    for frame in render.feed(event):
                        yield frame

    async def collect(self) -> list[Event]:
        """Runs to the end; each choice's reply parsed whole, so one event per piece, then
        :class:`Usage` unless the client left."""
        events: list[Event] = []
        for choice, done in enumerate(await accumulate(self._run)):
            if done.prompt_logprobs is not None:
                events.append(PromptLogprobs(choice, done.prompt_logprobs))
            if done.logprobs:
                events.append(TokenLogprobs(choice, done.logprobs))
            reply, has_calls = parse_reply(
                choice, "".join(done.text), self.plan.parser, self.reasoning
            )
            events += reply
            events.append(self._finished(choice, done.finish_reason, done.stop_reason, has_calls))
        if not self._run.disconnected:
            events.append(self._run.usage())
        return events

    def _finished(
        self, choice: int, reason: str | None, stop: str | int | None, has_calls: bool
    ) -> ChoiceFinished:
        reason = finish_reason_of(self.plan, reason, has_calls)
        return ChoiceFinished(choice, reason, stop, has_calls)


def submit_chat(
    host: ModelHost, model: LoadedModel, raw: Request, request: EngineCoreRequest, plan: ToolPlan
) -> ChatGeneration:
    """Submits ``request`` (a rendered chat prompt) on ``model`` (taken again by the caller
    since it was rendered, with nothing awaited since: it cannot be unloaded in between);
    ``InvalidRequestError`` naming the chat field at fault."""
    try:
        with host.refusing_a_dead_engine():
            streams = submit_prompts(model.engine, [request])
    except InvalidRequestError as exc:
        if exc.param == "prompt":  # the chat request's prompt is its messages
            exc.param = "messages"
        raise
    run = EngineRun(model.engine, raw, streams, request.params.n)
    parser = host.launch.reasoning_parser
    return ChatGeneration(run, request.request_id, plan, parser, len(request.prompt_token_ids))
