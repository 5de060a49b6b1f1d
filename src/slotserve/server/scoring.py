"""POST /v1/rerank (the Jina/Cohere shape vLLM and llama-server accept) and POST /v1/score
(vLLM's), for cross-encoder models (``ModelInfo.cross_encoder``).

Each (query, document) pair becomes one prompt and one engine request with
``SamplingParams(embed=True)``, through the same pipeline as /v1/embeddings
(:func:`pool_prompts`): the runner ends it with a one-value ``RequestOutput.embedding``, the
pair's relevance score (not normalised).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.runner_interface import PairTokenizer
from slotserve.hosting.served import LoadedModel
from slotserve.protocol.score_pairs import carries_pair_roles, pair_prompt
from slotserve.server.embeddings import MAX_INPUTS, pool_prompts
from slotserve.server.prompt_bound import check_prompt_chars
from slotserve.server.serving import ServingContext, large_body


class _ScoringFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's, as on the other routes
    # vLLM's: the request's place in line under --schedule-policy priority (lower first).
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)


class RerankRequest(_ScoringFields):
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)  # None: all documents
    return_documents: bool = True


class ScoreRequest(_ScoringFields):
    text_1: str | list[str]
    text_2: str | list[str]


@dataclass(frozen=True)
class _Route:
    """What differs between the two routes below the request body: the engine id's prefix, and
    the fields the pair's two texts came from (named by a too-long text's 400)."""

    prefix: str
    params: tuple[str, str]


_RERANK = _Route("rerank", ("query", "documents"))
_SCORE = _Route("score", ("text_1", "text_2"))


def _score_pairs(
    model: LoadedModel, pairs: list[tuple[str, str]], params: tuple[str, str]
) -> list[list[int]]:
    """Each pair as one prompt (``protocol/score_pairs.py``)."""
    tokenizer = model.tokenizer
    assert isinstance(tokenizer, PairTokenizer), "cross-encoders are served by HF tokenizers"
    template = model.chat_template if carries_pair_roles(model.chat_template) else None
    prompts = []
    for first, second in pairs:
        for text, param in zip((first, second), params, strict=True):
            check_prompt_chars(model, text, param)
        prompts.append(pair_prompt(tokenizer, template, first, second))
    return prompts


def _score_of(output: RequestOutput) -> float:
    assert output.embedding is not None, "a score request ended without its score"
    return output.embedding[0]


async def _scores(
    ctx: ServingContext,
    body: _ScoringFields,
    raw: Request,
    http_request_id: str,
    pairs: list[tuple[str, str]],
    route: _Route,
) -> tuple[str, list[RequestOutput] | None]:
    host, model = await ctx.acquire(body.model, raw, body.keep_alive)
    if not model.info.cross_encoder:
        kinds = (("generation", model.info.can_generate), ("embeddings", model.info.can_embed))
        serves = " and ".join(kind for kind, served in kinds if served)
        raise InvalidRequestError(
            f"The model {host.name} is not a cross-encoder (it serves {serves}); rerank and "
            "score need one (a sequence classifier with one label, or a causal LM served with "
            "--classifier-from-token).",
            param="model",
        )
    if len(pairs) > MAX_INPUTS:
        raise InvalidRequestError(f"At most {MAX_INPUTS} pairs per request.")
    prompts = await host.off_loop(model, large_body(raw), _score_pairs, model, pairs, route.params)
    finals = await pool_prompts(
        host, model, route.prefix, http_request_id, prompts, body.priority, raw
    )
    return host.name, finals


async def create_rerank(
    ctx: ServingContext, body: RerankRequest, raw: Request, http_request_id: str
) -> Response:
    if not body.documents:
        raise InvalidRequestError("'documents' must not be empty.", param="documents")
    pairs = [(body.query, document) for document in body.documents]
    name, finals = await _scores(ctx, body, raw, http_request_id, pairs, _RERANK)
    if finals is None:
        return Response(status_code=499)
    order = sorted(range(len(finals)), key=lambda k: _score_of(finals[k]), reverse=True)
    results = []
    for index in order[: body.top_n]:
        result: dict[str, object] = {"index": index, "relevance_score": _score_of(finals[index])}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    tokens = sum(out.num_prompt_tokens for out in finals)
    return JSONResponse(
        {
            "id": f"rerank-{http_request_id}",
            "model": name,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
    )


def _score_pairs_of(body: ScoreRequest) -> list[tuple[str, str]]:
    """vLLM's rule: one first text against each second text (1:N), or pairwise (N:N)."""
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not firsts or not seconds:
        raise InvalidRequestError("'text_1' and 'text_2' must not be empty.", param="text_1")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"'text_1' holds {len(firsts)} texts and 'text_2' {len(seconds)}: the lengths must "
            "be 1:1, 1:N or N:N.",
            param="text_2",
        )
    return list(zip(firsts, seconds, strict=True))


async def create_score(
    ctx: ServingContext, body: ScoreRequest, raw: Request, http_request_id: str
) -> Response:
    pairs = _score_pairs_of(body)
    name, finals = await _scores(ctx, body, raw, http_request_id, pairs, _SCORE)
    if finals is None:
        return Response(status_code=499)
    tokens = sum(out.num_prompt_tokens for out in finals)
    return JSONResponse(
        {
            "id": f"score-{http_request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": name,
            "data": [
                {"index": index, "object": "score", "score": _score_of(final)}
                for index, final in enumerate(finals)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
