"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import SampledToken, SequenceDelta
from slotserve.hosting.served import LoadedModel
from slotserve.server.generation import EngineRun, accumulate, submit_prompts, with_engine_ids
from slotserve.server.openai.params import sampling_params_of, structured_output_of
from slotserve.server.openai.protocol import CompletionRequest
from slotserve.server.openai.shapes import (
    Envelope,
    completion_logprobs,
    echo_logprobs,
    ended_on_failure,
    join_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from slotserve.server.prompt_bound import check_prompt_chars
from slotserve.server.serving import (
    ServingContext,
    engine_request_id,
    large_body,
    request_adapter,
    served_name,
)

MAX_PROMPTS = 64


def prompt_items(raw: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt or input field as a list of items, each a text or a list of token ids:
    a lone string or a lone list of ids is one item."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [[int(x) for x in raw]]  # type: ignore[arg-type]
    return list(raw)  # type: ignore[arg-type]


def _prompts(model: LoadedModel, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, token ids, or lists of ids)."""
    items = prompt_items(body.prompt)
    if not items:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise InvalidRequestError(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
    token_lists, texts = [], []
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(model, item, "prompt")
            token_lists.append(model.tokenizer.encode(item, add_special_tokens=True))
            texts.append(item)
        else:
            token_lists.append(list(item))
            raw_bytes = b"".join(
                model.tokenizer.token_bytes(t) for t in item if 0 <= t < model.info.vocab_size
            )
            texts.append(raw_bytes.decode("utf-8", errors="replace"))
    return token_lists, texts


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, raw: Request, http_request_id: str
) -> Response:
    body.reject_unsupported()
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    prompts, prompt_texts = await host.off_loop(model, large_body(raw), _prompts, model, body)
    model = host.require_same(model)  # nothing awaits from here to the submission
    request_id = engine_request_id(model, "cmpl", http_request_id, len(prompts))
    # echo + logprobs: the prompt's tokens are scored too (OpenAI's legacy completions).
    echo_scored = body.logprobs if body.echo and body.logprobs is not None else None
    asked = [v for v in (body.prompt_logprobs, echo_scored) if v is not None]
    params = sampling_params_of(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        structured_output=structured_output_of(body),
        prompt_logprobs=max(asked) if asked else None,
        defaults=model.sampling_defaults,
    )
    with host.refusing_a_dead_engine():
        adapter = request_adapter(raw)
        requests = [
            EngineCoreRequest(rid, prompt, params, body.priority, adapter)
            for rid, prompt in with_engine_ids(request_id, prompts)
        ]
        streams = submit_prompts(model.engine, requests)
    envelope = Envelope(
        request_id, "text_completion", int(time.time()), served_name(host, raw), body.include_usage
    )
    n = body.n
    run = EngineRun(model.engine, raw, streams, n)
    tokenizer = model.tokenizer
    echo = [prompt_texts[i // n] if body.echo else "" for i in range(run.num_choices)]

    def logprobs_of(
        index: int, tokens: list[SampledToken] | None, scores: list[SampledToken] | None, at: int
    ) -> dict[str, Any] | None:
        """Completion logprobs from text offset ``at``, after the echoed prompt's own."""
        if body.logprobs is None:
            return None
        shaped = completion_logprobs(tokenizer, tokens or [], at)
        if echo_scored is not None and scores is not None:
            return join_logprobs(echo_logprobs(tokenizer, prompts[index // n], scores), shaped)
        return shaped if tokens else None

    if body.stream:
        offsets = [0] * run.num_choices

        def render(index: int, d: SequenceDelta) -> str | None:
            echoed, echo[index] = echo[index], ""
            text = echoed + d.text
            if not text and d.finish_reason is None and not d.logprobs:
                return None
            at = offsets[index] + len(echoed)
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": logprobs_of(index, d.logprobs, d.prompt_logprobs, at),
                "finish_reason": d.finish_reason,
            }
            if body.prompt_logprobs is not None and d.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, d.prompt_logprobs)
            offsets[index] += len(text)
            return envelope.chunk(choice)

        async def frames() -> AsyncGenerator[str, None]:
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for index, delta in deltas:
                    rendered = render(index, delta)
                    if rendered is not None:
                        yield rendered
            if not run.disconnected:
                for frame in envelope.ending(run.usage()):
                    yield frame

        return StreamingResponse(ended_on_failure(frames()), media_type="text/event-stream")
    choices = await accumulate(run)
    if run.disconnected:
        return Response(status_code=499)
    shaped = []
    for i, choice in enumerate(choices):
        scores = choices[i - i % n].prompt_logprobs  # the prompt's first choice has them
        entry: dict[str, Any] = {
            "index": i,
            "text": echo[i] + "".join(choice.text),
            "logprobs": logprobs_of(i, choice.logprobs, scores, len(echo[i])),
            "finish_reason": choice.finish_reason,
        }
        if body.prompt_logprobs is not None:
            entry["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, scores)
        shaped.append(entry)
    return JSONResponse({**envelope.fields(), "choices": shaped, "usage": usage(run.usage())})
