"""Helpers shared by the chat and text completion routes: running prompts through the engine,
noticing client disconnects, and shaping usage, logprobs and SSE frames."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from slotserve.engine.client.async_engine import AsyncEngine, RequestStream
from slotserve.engine.outputs import RequestOutput, SampledToken, SequenceDelta
from slotserve.engine.runner_interface import Tokenizer
from slotserve.engine.sampling_params import SamplingParams
from slotserve.server.errors import GenerationFailed, error_body, failure_error


def submit_prompts(
    engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[RequestStream]:
    """Submits one engine request per prompt; raises (4xx errors) before anything is queued
    for a prompt that fails validation, and withdraws the ones already queued."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
    streams: list[RequestStream] = []
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            streams.append(engine.submit(rid, prompt, params))
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


async def merge_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


@dataclass
class ChoiceAccumulator:
    """Everything one choice produced, for non-streaming responses."""

    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[SampledToken] | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.text.append(delta.text)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


@dataclass
class Collected:
    """A finished non-streaming generation: one accumulator per choice, and token totals."""

    choices: list[ChoiceAccumulator]
    usage: dict[str, Any]
    disconnected: bool


class _Totals:
    """Token counts per prompt (one engine request each), summed into OpenAI's usage."""

    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion = [0] * num_prompts

    def update(self, index: int, output: RequestOutput) -> None:
        self.prompt[index] = output.num_prompt_tokens
        self.cached[index] = output.num_cached_tokens
        self.completion[index] = output.num_output_tokens

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt), sum(self.completion), sum(self.cached))


async def collect(
    engine: AsyncEngine, raw: Request, streams: list[RequestStream], n: int
) -> Collected:
    """Runs the requests to the end; choice ``k * n + i`` is sequence ``i`` of prompt ``k``."""
    choices = [ChoiceAccumulator() for _ in range(len(streams) * n)]
    totals = _Totals(len(streams))
    async with abort_on_disconnect(raw, abort_all(streams)) as gone:
        async for k, output in merge_outputs(streams):
            if output.failure is not None:
                raise GenerationFailed(output, engine.config.request_timeout_s)
            for delta in output.deltas:
                choices[k * n + delta.index].add(delta)
            totals.update(k, output)
    return Collected(choices, totals.usage(), gone.is_set())


async def stream_events(
    engine: AsyncEngine,
    raw: Request,
    streams: list[RequestStream],
    n: int,
    opening: list[str],
    render: Callable[[int, SequenceDelta], str | None],
    usage_event: Callable[[dict[str, Any]], str] | None,
) -> AsyncIterator[str]:
    """SSE frames for a streaming response: ``opening``, one ``render``ed frame per delta,
    the usage frame when asked for, then ``[DONE]``. An engine error or the time limit ends
    the stream with an error frame; a client disconnect aborts the requests."""
    totals = _Totals(len(streams))
    async with abort_on_disconnect(raw, abort_all(streams)) as gone:
        for frame in opening:
            yield frame
        async for k, output in merge_outputs(streams):
            if output.failure is not None:
                status, message, type_, _ = failure_error(
                    output, output.request_id, engine.config.request_timeout_s
                )
                yield sse(error_body(message, type_, code=status))  # vLLM: the status as code
                yield SSE_DONE
                return
            for delta in output.deltas:
                rendered = render(k * n + delta.index, delta)
                if rendered is not None:
                    yield rendered
            totals.update(k, output)
    if gone.is_set():
        return
    if usage_event is not None:
        yield usage_event(totals.usage())
    yield SSE_DONE


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # Prompt tokens whose KV came from the prefix cache instead of being computed.
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(tokenizer: Tokenizer, tokens: list[SampledToken]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        # A byte-fallback token carries part of a character: report its own bytes.
        raw = tokenizer.token_bytes(token_id) or text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = []
    for sampled in tokens:
        item = entry(sampled.token_id, sampled.logprob if sampled.logprob is not None else 0.0)
        item["top_logprobs"] = [entry(t, lp) for t, lp in sampled.top_logprobs]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, scores: list[SampledToken] | None
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a map from
    token id to its logprob and text (the prompt's token first, then the top alternatives)."""
    if scores is None:
        return None
    entries: list[dict[str, Any] | None] = [None]
    for scored in scores:
        entry = {
            str(scored.token_id): {
                "logprob": scored.logprob,
                "rank": None,
                "decoded_token": tokenizer.token_text(scored.token_id),
            }
        }
        for rank, (token_id, logprob) in enumerate(scored.top_logprobs, start=1):
            entry.setdefault(
                str(token_id),
                {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)},
            )
            if token_id == scored.token_id:
                entry[str(token_id)]["rank"] = rank
        entries.append(entry)
    return entries


def echo_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], scores: list[SampledToken]
) -> dict[str, Any]:
    """OpenAI's completion logprobs of an echoed prompt: the first token has none."""
    return completion_logprobs(tokenizer, [SampledToken(prompt_ids[0]), *scores], 0)


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first}


def completion_logprobs(
    tokenizer: Tokenizer, tokens: list[SampledToken], text_offset: int
) -> dict[str, Any]:
    texts = [tokenizer.token_text(s.token_id) for s in tokens]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [s.logprob for s in tokens],
        # None where the token has no logprob at all: an echoed prompt's first token.
        "top_logprobs": [
            None if s.logprob is None else {tokenizer.token_text(t): lp for t, lp in s.top_logprobs}
            for s in tokens
        ],
        "text_offset": offsets,
    }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
