"""POST /v1/embeddings, in OpenAI's shape.

Each input becomes one engine request with ``SamplingParams(embed=True)``: the engine computes
its prompt beside whatever else runs (generation included) and ends it with the pooled,
L2-normalised vector (``RequestOutput.embedding``), no token sampled.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import LoadedModel
from slotserve.server.errors import GenerationFailed
from slotserve.server.generation import (
    abort_all,
    abort_on_disconnect,
    merge_outputs,
    submit_prompts,
    with_engine_ids,
)
from slotserve.server.openai.completions import prompt_items
from slotserve.server.prompt_bound import check_prompt_chars
from slotserve.server.serving import (
    ServingContext,
    engine_request_id,
    large_body,
    request_adapter,
)

# Inputs of one request; each takes a place in the engine's queue (``--max-queue``).
MAX_INPUTS = 64


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models (trained so that a prefix of the vector is an embedding too) can
    # shorten their vectors; no model served here is one, so any value is refused.
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extension: keep only the last N tokens of each input instead of refusing it.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    keep_alive: float | str | None = None  # Ollama's, as on the generation routes
    # vLLM's: the request's place in line under --schedule-policy priority (lower first).
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)


def _inputs(model: LoadedModel, body: EmbeddingRequest) -> list[list[int]]:
    items = prompt_items(body.input)
    if not items:
        raise InvalidRequestError("'input' must not be empty.", param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"At most {MAX_INPUTS} inputs per request.", param="input")
    token_lists: list[list[int]] = []
    for k, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise InvalidRequestError(f"'input[{k}]' must not be an empty string.", param="input")
        if isinstance(item, str) and body.truncate_prompt_tokens is None:
            check_prompt_chars(model, item, "input")
        tokens = model.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not tokens:
            raise InvalidRequestError(f"'input[{k}]' holds no token.", param="input")
        if body.truncate_prompt_tokens is not None:
            tokens = tokens[-body.truncate_prompt_tokens :]
        token_lists.append(tokens)
    return token_lists


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embeddings(
    ctx: ServingContext, body: EmbeddingRequest, raw: Request, http_request_id: str
) -> Response:
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    if model.info.cross_encoder:
        raise InvalidRequestError(
            f"The model {host.name} is a cross-encoder: it serves /v1/rerank and /v1/score, "
            "not embeddings.",
            param="model",
        )
    if not model.info.can_embed:
        raise InvalidRequestError(
            f"The model {host.name} does not serve embeddings.", param="model"
        )
    if body.dimensions is not None:
        raise InvalidRequestError(
            f"'dimensions' is only for Matryoshka embedding models; {host.name} is not one.",
            param="dimensions",
        )
    prompts = await host.off_loop(model, large_body(raw), _inputs, model, body)
    finals = await pool_prompts(host, model, "embd", http_request_id, prompts, body.priority, raw)
    if finals is None:
        return Response(status_code=499)
    data = []
    for index, final in enumerate(finals):
        vector = final.embedding
        assert vector is not None, "an embedding request ended without its vector"
        data.append(
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(vector, body.encoding_format),
            }
        )
    tokens = sum(out.num_prompt_tokens for out in finals)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": host.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def pool_prompts(
    host: ModelHost,
    model: LoadedModel,
    prefix: str,
    http_request_id: str,
    prompts: list[list[int]],
    priority: int,
    raw: Request,
) -> list[RequestOutput] | None:
    """Runs each prompt as one pooled engine request (an embedding, or a cross-encoder's
    score) and returns their final outputs in order; None when the client left."""
    model = host.require_same(model)  # nothing awaits from here to the submission
    request_id = engine_request_id(model, prefix, http_request_id, len(prompts))
    with host.refusing_a_dead_engine():
        params, adapter = SamplingParams(embed=True), request_adapter(raw)
        requests = [
            EngineCoreRequest(rid, prompt, params, priority, adapter)
            for rid, prompt in with_engine_ids(request_id, prompts)
        ]
        streams = submit_prompts(model.engine, requests)
    finals: dict[int, RequestOutput] = {}
    async with (
        abort_on_disconnect(raw, abort_all(streams)) as gone,
        contextlib.aclosing(merge_outputs(streams)) as outputs,
    ):
        async for index, output in outputs:
            if output.failure is not None:
                raise GenerationFailed(output, model.engine.config.request_timeout_s)
            if output.finished:
                finals[index] = output
    if gone.is_set() or len(finals) < len(prompts):
        return None
    return [finals[index] for index in range(len(prompts))]
