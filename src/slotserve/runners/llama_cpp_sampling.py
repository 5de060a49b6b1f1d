"""Per-sequence sampler chains built from llama.cpp's sampler API, so sampling runs in C.

Chain order (as llama.cpp's own server builds it): logit bias → grammar → penalties →
top-k → top-p → min-p → temperature → draw. Greedy requests with no bias, penalty or grammar
never get a chain: the runner takes the argmax of the logits directly.

Penalties follow the OpenAI / vLLM meaning: presence and frequency penalties count generated
tokens only, the repetition penalty counts prompt and generated tokens. llama.cpp has one
penalties sampler for all three, so the repetition penalty gets a sampler of its own that is
also fed the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp as llama
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput


def grammar_for(spec: StructuredOutput) -> str:
    """GBNF text for a structured-output request; raises ``InvalidRequestError``."""
    if spec.kind == "json_object":
        return str(JSON_GBNF)
    if spec.kind == "grammar":
        if not spec.spec:
            raise InvalidRequestError("The grammar must not be empty.", param="grammar")
        return spec.spec
    try:
        return str(json_schema_to_gbnf(spec.spec or "{}"))
    # The converter reports unsupported schemas with assertions and whatever else it hits.
    except Exception as exc:
        raise InvalidRequestError(
            f"Unsupported JSON schema: {exc}", param="response_format"
        ) from exc


def check_grammar(vocab: Any, spec: StructuredOutput) -> None:
    """Raises ``InvalidRequestError`` unless llama.cpp's grammar sampler accepts ``spec``."""
    sampler = llama.llama_sampler_init_grammar(vocab, grammar_for(spec).encode(), b"root")
    if not sampler:
        raise InvalidRequestError("The grammar could not be parsed.", param="response_format")
    llama.llama_sampler_free(sampler)


def build_chain(
    vocab: Any,
    n_vocab: int,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    seed: int | None,
    max_seq_len: int,
) -> Any:
    """Returns a new sampler chain (owned by the caller: free with ``llama_sampler_free``)."""
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    try:
        if params.logit_bias:
            biases = (llama.llama_logit_bias * len(params.logit_bias))()
            for i, (token_id, bias) in enumerate(params.logit_bias):
                biases[i].token = token_id
                biases[i].bias = bias
            _add(chain, llama.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
        if params.structured_output is not None:
            grammar = grammar_for(params.structured_output).encode()
            _add(chain, llama.llama_sampler_init_grammar(vocab, grammar, b"root"))
        if params.repetition_penalty != 1.0:
            repetition = llama.llama_sampler_init_penalties(
                n_vocab, max_seq_len, params.repetition_penalty, 0.0, 0.0
            )
            _add(chain, repetition)
            for token_id in prompt_token_ids:
                llama.llama_sampler_accept(repetition, token_id)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            _add(
                chain,
                llama.llama_sampler_init_penalties(
                    n_vocab, max_seq_len, 1.0, params.frequency_penalty, params.presence_penalty
                ),
            )
        if params.is_greedy:
            _add(chain, llama.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            _add(chain, llama.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            _add(chain, llama.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            _add(chain, llama.llama_sampler_init_min_p(params.min_p, 1))
        _add(chain, llama.llama_sampler_init_temp(params.temperature))
        draw_seed = llama.LLAMA_DEFAULT_SEED if seed is None else seed % 0xFFFFFFFF
        _add(chain, llama.llama_sampler_init_dist(draw_seed))
    except BaseException:
        llama.llama_sampler_free(chain)
        raise
    return chain


def _add(chain: Any, sampler: Any) -> None:
    if not sampler:
        raise InvalidRequestError("llama.cpp refused the sampling parameters (bad grammar?).")
    llama.llama_sampler_chain_add(chain, sampler)
