"""Maps OpenAI request fields onto the engine's :class:`SamplingParams`."""

from __future__ import annotations

import json

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_defaults import SamplingDefaults
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput
from slotserve.server.openai.protocol import SamplingFields


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


def structured_output_of(body: SamplingFields) -> StructuredOutput | None:
    """The request's one constraint on the output text; 400 when it names several."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput("json_object"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs a 'json_schema' object.",
                param="response_format",
            )
        found.append(StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        param = "structured_outputs"
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            found.append(StructuredOutput("json_schema", schema, param))
        if so.regex is not None:
            found.append(StructuredOutput("regex", so.regex, param))
        if so.choice is not None:
            found.append(StructuredOutput("choice", json.dumps(so.choice), param))
        if so.grammar is not None:
            found.append(StructuredOutput("grammar", so.grammar, param))
        if so.json_object:
            found.append(StructuredOutput("json_object", None, param))
        if not found:
            raise InvalidRequestError("structured_outputs names no constraint.", param=param)
    if body.regex is not None:
        found.append(StructuredOutput("regex", body.regex, "regex"))
    if body.ebnf is not None:
        found.append(StructuredOutput("grammar", body.ebnf, "ebnf"))
    if len(found) > 1:
        raise InvalidRequestError(
            "Give one output constraint: response_format, structured_outputs (one key), "
            "regex or ebnf.",
            param=found[1].param,
        )
    return found[0] if found else None


def sampling_params_of(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured_output: StructuredOutput | None,
    prompt_logprobs: int | None = None,
    *,
    defaults: SamplingDefaults,
) -> SamplingParams:
    """The request's sampling; a field it leaves out takes the model's default in force
    (``LoadedModel.sampling_defaults``), so every API samples alike."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    given = SamplingDefaults.taken_from(body)
    return SamplingParams(
        max_tokens=max_tokens,
        **given.params(defaults),
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
        prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
    )
