"""POST /v1/chat/completions (SPEC S1)."""

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
)
from slotserve.server.params import sampling_params_of, structured_output_of
from slotserve.server.protocol import ChatCompletionRequest
from slotserve.server.serving import ServingContext, engine_request_id, require_chat_template


def _message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content or ""})
    return messages


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: Request, http_request_id: str
) -> Response:
    ctx.check_model(body.model)
    body.reject_unsupported()
    model = ctx.host.require_ready()  # 503 while loading, unhealthy or draining
    request_id = engine_request_id(model, "chatcmpl", http_request_id)
    template = require_chat_template(model)
    prompt_text = template.render(_message_dicts(body), add_generation_prompt=True)
    add_bos = not (template.bos_token and prompt_text.startswith(template.bos_token))
    prompt = model.tokenizer.encode(prompt_text, add_special_tokens=add_bos)
    params = sampling_params_of(
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured_output=structured_output_of(body.response_format),
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
        "model": ctx.model_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        extra: dict[str, Any] = {"usage": None} if include_usage else {}

        def frame(
            index: int,
            delta: dict[str, Any],
            finish: str | None,
            logprobs: dict[str, Any] | None = None,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**base, "choices": [choice], **extra})

        def render(index: int, d: SequenceDelta) -> str | None:
            if not d.text and d.finish_reason is None and not d.logprobs:
                return None
            logprobs = chat_logprobs(model.tokenizer, d.logprobs) if d.logprobs else None
            return frame(index, {"content": d.text} if d.text else {}, d.finish_reason, logprobs)

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
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": ctx.model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(model.tokenizer, c.logprobs)
                    if body.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(result.choices)
            ],
            "usage": result.usage,
        }
    )
