"""POST /v1/chat/completions: messages through the chat template, tools planned
(``tool_calling.py``), the reply shaped into content, reasoning and tool calls
(``chat_output.py``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import SequenceDelta
from slotserve.server.generation import (
    chat_logprobs,
    collect,
    sse,
    stream_events,
    submit_prompts,
    vllm_prompt_logprobs,
)
from slotserve.server.openai.chat_output import DeltaShaper, finish_reason_of, message_of
from slotserve.server.openai.params import sampling_params_of, structured_output_of
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.openai.tool_calling import plan_tools, template_messages
from slotserve.server.serving import ServingContext, engine_request_id, require_chat_template


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: Request, http_request_id: str
) -> Response:
    body.reject_unsupported()
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    request_id = engine_request_id(model, "chatcmpl", http_request_id)
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
    prompt = model.tokenizer.encode(prompt_text, add_special_tokens=add_bos)
    constraint = structured_output_of(body)
    if plan.constraint is not None:
        if constraint is not None:
            raise InvalidRequestError(
                "An output constraint cannot be combined with a forced tool call "
                "(tool_choice 'required' or a named function).",
                param=constraint.param,
            )
        constraint = plan.constraint
    params = sampling_params_of(
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured_output=constraint,
    )
    try:
        streams = submit_prompts(model.engine, request_id, [prompt], params)
    except InvalidRequestError as exc:
        if exc.param == "prompt":  # the chat request's prompt is its messages
            exc.param = "messages"
        raise
    created = int(time.time())
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": host.name,
    }
    reasoning = host.launch.reasoning_parser
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        shapers = [DeltaShaper(plan, reasoning) for _ in range(body.n)]

        def frame(
            index: int,
            delta: dict[str, Any],
            finish: str | None,
            logprobs: dict[str, Any] | None = None,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**base, "choices": [choice], **extra})

        def render(index: int, d: SequenceDelta) -> str | None:
            shaper = shapers[index]
            deltas = shaper.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                deltas += shaper.finish()
            logprobs = chat_logprobs(model.tokenizer, d.logprobs) if d.logprobs else None
            if logprobs is not None and not deltas:
                deltas = [{}]  # the tokens' logprobs go out even while their text is held
            frames = [
                frame(index, delta, None, logprobs if k == 0 else None)
                for k, delta in enumerate(deltas)
            ]
            if d.finish_reason is not None:
                reason = finish_reason_of(plan, d.finish_reason, shaper.has_calls)
                frames.append(frame(index, {}, reason))
            return "".join(frames) or None

        opening = [frame(i, {"role": "assistant", "content": ""}, None) for i in range(body.n)]
        usage_event = (
            (lambda u: sse({**base, "choices": [], "usage": u})) if include_usage else None
        )
        return StreamingResponse(
            stream_events(model.engine, raw, streams, body.n, opening, render, usage_event),
            media_type="text/event-stream",
        )
    result = await collect(model.engine, raw, streams, body.n)
    if result.disconnected:
        return Response(status_code=499)
    choices = []
    for i, c in enumerate(result.choices):
        message, has_calls = message_of("".join(c.text), plan, reasoning)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(model.tokenizer, c.logprobs) if body.logprobs else None,
                "finish_reason": finish_reason_of(plan, c.finish_reason, has_calls),
            }
        )
    response: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": host.name,
        "choices": choices,
        "usage": result.usage,
    }
    if body.prompt_logprobs is not None:  # vLLM's extension: the rendered prompt's tokens
        response["prompt_logprobs"] = vllm_prompt_logprobs(
            model.tokenizer, result.choices[0].prompt_logprobs
        )
    return JSONResponse(response)
