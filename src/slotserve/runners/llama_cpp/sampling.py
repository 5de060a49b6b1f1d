"""Per-sequence sampler chains built from llama.cpp's sampler API, so sampling runs in C.

Chain order (as llama.cpp's own server builds it): logit bias → penalties → top-k → top-p →
min-p → temperature → draw. Greedy requests with no bias or penalty never get a chain: the
runner takes the argmax of the logits directly. A structured-output grammar is not in the
chain: the engine's token mask is applied to the logits before it
(engine/decoding/structured_output.py).

Penalties follow the OpenAI / vLLM meaning: presence and frequency penalties count generated
tokens only, the repetition penalty counts prompt and generated tokens. llama.cpp has one
penalties sampler for all three, so the repetition penalty gets a sampler of its own that is
also fed the prompt.

``sample_row``: one output row's token, by its chain or the argmax, under the structured-output
mask. ``with_logprobs``: a sampled token's log-probability and the top alternatives under the raw
logits, for the runner's sampled and prompt positions alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp as llama
import numpy as np

from slotserve.engine.decoding.structured_output import allowed_mask
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_params import SamplingParams


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
        raise InvalidRequestError("llama.cpp refused the sampling parameters.")
    llama.llama_sampler_chain_add(chain, sampler)


def sample_row(
    ctx: Any,
    batch_row: int,
    logits: np.ndarray[Any, Any],
    params: SamplingParams,
    chain: Any | None,
    allowed: np.ndarray[Any, Any] | None,
) -> SampledToken:
    """The token of output row ``batch_row`` (whose ``logits`` are llama.cpp's buffer):
    drawn by the sequence's ``chain``, or the argmax where it has none; ``allowed`` masks it."""
    raw = logits
    if allowed is not None:  # structured output: the sampler reads the buffer, masked here
        if params.logprobs is not None:
            raw = logits.copy()
        logits[~allowed_mask(allowed, len(logits))] = -np.inf
    if chain is None:
        token_id = int(logits.argmax())
    else:
        token_id = llama.llama_sampler_sample(chain, ctx, batch_row)
    if params.logprobs is None:
        return SampledToken(token_id)
    return with_logprobs(token_id, raw, params.logprobs)


def with_logprobs(token_id: int, logits: np.ndarray[Any, Any], top_k: int) -> SampledToken:
    """Log-probabilities under the model's raw distribution (before any sampling transform)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    log_norm = float(np.log(np.exp(shifted).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_k > 0:
        best = np.argpartition(-shifted, top_k)[:top_k]
        best = best[np.argsort(-shifted[best], kind="stable")]
        top = tuple((int(t), float(shifted[t]) - log_norm) for t in best)
    return SampledToken(token_id, float(shifted[token_id]) - log_norm, top)
