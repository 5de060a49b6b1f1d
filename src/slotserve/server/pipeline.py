"""A chat request through the engine, as typed events.

:func:`start_chat` renders the messages with the chat template, plans the tools
(``openai/tool_calling.py``), maps the sampling fields and submits; :class:`ChatGeneration`
then turns what the engine makes into events (``events.py``): the reply split into thinking,
text and tool calls (``reply_parser.py``), each choice's finish, the usage. The chat
completions and Responses routes both run here and differ only in how they render the events.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import SamplingParams
from slotserve.models.host import LoadedModel, ModelHost
from slotserve.protocol.reasoning import ReasoningParser
from slotserve.server.events import ChoiceFinished, Event, PromptLogprobs, TokenLogprobs
from slotserve.server.generation import EngineRun, accumulate, submit_prompts
from slotserve.server.openai.params import sampling_params_of, structured_output_of
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.openai.tool_calling import ToolPlan, plan_tools, template_messages
from slotserve.server.prompt_bound import check_prompt_chars
from slotserve.server.reply_parser import ReplyParser, parse_reply
from slotserve.server.serving import engine_request_id, require_chat_template


def finish_reason_of(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: ``tool_calls`` when the model ended on calls it chose to make (never with
    an empty list); a forced named function keeps ``stop``."""
    if has_calls and reason == "stop" and not plan.named:
        return "tool_calls"
    return reason


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


async def start_chat(
    host: ModelHost,
    model: LoadedModel,
    body: ChatCompletionRequest,
    raw: Request,
    http_request_id: str,
) -> ChatGeneration:
    """Renders, plans and submits ``body`` on ``model`` (acquired by the caller);
    ``InvalidRequestError`` naming the chat field at fault. The rendering runs off the event
    loop; the model is checked again after it, and nothing awaits from there to the
    submission, so the model cannot be unloaded in between."""
    prompt, plan = await host.off_loop(model, render_chat, host, model, body)
    model = host.require_same(model)
    request_id = engine_request_id(model, "chatcmpl", http_request_id)
    params = _sampling_params(body, plan, model)
    try:
        with host.refusing_a_dead_engine():
            streams = submit_prompts(model.engine, request_id, [prompt], params)
    except InvalidRequestError as exc:
        if exc.param == "prompt":  # the chat request's prompt is its messages
            exc.param = "messages"
        raise
    run = EngineRun(model.engine, raw, streams, body.n)
    return ChatGeneration(run, request_id, plan, host.launch.reasoning_parser, len(prompt))


def render_chat(
    host: ModelHost,
    model: LoadedModel,
    body: ChatCompletionRequest,
    add_special_tokens: bool | None = None,
    check_length: bool = True,
) -> tuple[list[int], ToolPlan]:
    """The prompt's token ids as :func:`start_chat` submits them, and the tool plan; also
    what counting a request's tokens reads, so a count and a run cannot disagree.
    ``add_special_tokens`` None: the BOS token unless the template writes it itself (a second
    one would change the prompt). ``check_length``: refuse a prompt whose characters alone
    cannot fit the context before tokenizing it (counting routes count it anyway). Slow for
    a long conversation: call it off the event loop (``ModelHost.off_loop``)."""
    template = require_chat_template(model)
    plan = plan_tools(body, template, host.launch.tool_call_parser)
    prompt_text = template.render(
        template_messages(body, plan),
        add_generation_prompt=body.add_generation_prompt,
        tools=plan.template_tools,
        extra=body.chat_template_kwargs,
        continue_final_message=body.continue_final_message,
    )
    add_bos = not (template.bos_token and prompt_text.startswith(template.bos_token))
    if add_special_tokens is not None:
        add_bos = add_special_tokens
    if check_length:
        check_prompt_chars(model, prompt_text, "messages")
    return model.tokenizer.encode(prompt_text, add_special_tokens=add_bos), plan


def _sampling_params(
    body: ChatCompletionRequest, plan: ToolPlan, model: LoadedModel
) -> SamplingParams:
    constraint = structured_output_of(body)
    if plan.constraint is not None:
        if constraint is not None:
            raise InvalidRequestError(
                "An output constraint cannot be combined with a forced tool call "
                "(tool_choice 'required' or a named function).",
                param=constraint.param,
            )
        constraint = plan.constraint
    return sampling_params_of(
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured_output=constraint,
        defaults=model.sampling_defaults,
    )
