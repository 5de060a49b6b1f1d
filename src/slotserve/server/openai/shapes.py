"""OpenAI's wire shapes shared by chat and text completions: the fields every answer of one
request starts with, the stream's chunks and ending, usage and log-probabilities."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import Tokenizer
from slotserve.server.errors import GenerationFailed, stream_error
from slotserve.server.events import Usage
from slotserve.server.sse import SSE_DONE, sse


@dataclass(frozen=True)
class Envelope:
    """``id``, ``object``, ``created`` and ``model`` of one answer; for a stream, whether its
    chunks carry ``usage`` (``stream_options.include_usage``)."""

    id: str
    object: str
    created: int
    model: str
    include_usage: bool = False

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def chunk(self, choice: dict[str, Any]) -> str:
        extra: dict[str, Any] = {"usage": None} if self.include_usage else {}
        return sse({**self.fields(), "choices": [choice], **extra})

    def ending(self, totals: Usage) -> list[str]:
        """The frames after the last choice's: the usage chunk when asked for, then [DONE]."""
        if not self.include_usage:
            return [SSE_DONE]
        return [sse({**self.fields(), "choices": [], "usage": usage(totals)}), SSE_DONE]


async def ended_on_failure(frames: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``frames``; when the engine ends the request early (an error, the time limit) the
    stream ends with an error frame and [DONE] instead."""
    try:
        async with contextlib.aclosing(frames) as inner:
            async for frame in inner:
                yield frame
    except GenerationFailed as exc:
        yield sse(stream_error(exc))
        yield SSE_DONE


def usage(totals: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "total_tokens": totals.total_tokens,
        # Prompt tokens whose KV came from the prefix cache instead of being computed.
        "prompt_tokens_details": {"cached_tokens": totals.cached_tokens},
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
