"""Maps OpenAI request fields onto the engine's :class:`SamplingParams`."""

from __future__ import annotations

import json

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput
from slotserve.server.protocol import ResponseFormat, SamplingFields


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    pairs = []
    for key, bias in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got '{key}'.", param="logit_bias"
            ) from None
        pairs.append((token_id, float(bias)))
    return tuple(pairs)


def structured_output_of(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format of type 'json_schema' needs a 'json_schema' object.",
            param="response_format",
        )
    return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))


def sampling_params_of(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured_output: StructuredOutput | None,
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=logprobs,
        structured_output=structured_output,
    )
