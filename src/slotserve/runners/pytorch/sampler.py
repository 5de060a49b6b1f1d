"""Batched sampling on the device, one row per sequence that needs a token.

Order, as vLLM applies it: logit bias → penalties → structured-output mask → (greedy: argmax)
→ temperature → top-k → top-p → min-p → draw. Penalties follow OpenAI / vLLM: presence and
frequency count generated tokens; the repetition penalty (divide positive logits, multiply
negative ones) counts prompt and generated tokens. Log-probabilities come from the raw
logits, before any of this.

The draw is an inverse-CDF lookup of one uniform number from the sequence's own generator
(seeded with ``seed + choice index``, else from the OS): a seeded sequence draws the same
tokens alone or batched, and every row's arithmetic is its own (row-wise softmax and scans).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotserve.engine.decoding.structured_output import allowed_mask
from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_params import SamplingParams


@dataclass
class SequenceSampler:
    """Per-slot sampling state."""

    params: SamplingParams
    generator: torch.Generator
    output_counts: torch.Tensor | None  # [vocab] generated-token counts (presence/frequency)
    seen: torch.Tensor | None  # [vocab] bool: in the prompt or generated (repetition)
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None


def new_sequence_sampler(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    seed: int | None,
    vocab_size: int,
    device: torch.device,
) -> SequenceSampler:
    generator = torch.Generator(device=device)
    generator.manual_seed(random.SystemRandom().getrandbits(63) if seed is None else seed % (2**63))
    counts = seen = bias_ids = bias_values = None
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt_token_ids:
            seen[torch.tensor(list(prompt_token_ids), device=device)] = True
    if params.logit_bias:
        bias_ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        bias_values = torch.tensor([b for _, b in params.logit_bias], device=device)
    return SequenceSampler(params, generator, counts, seen, bias_ids, bias_values)


def sample(
    logits: torch.Tensor,
    samplers: Sequence[SequenceSampler],
    allowed: Sequence[np.ndarray[Any, Any] | None] = (),
) -> list[SampledToken]:
    """``logits``: float32 [rows, vocab], row ``i`` for ``samplers[i]``; ``allowed[i]``, when
    given and not None, is row ``i``'s structured-output bitmask (``ScheduledChunk``)."""
    masked = [row for row, mask in enumerate(allowed) if mask is not None]
    if not masked and all(_plain_greedy(s) for s in samplers):
        return [SampledToken(t) for t in logits.argmax(dim=-1).tolist()]
    rows = len(samplers)
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in samplers):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = logits
    if masked or any(_modifies(s.params) for s in samplers):
        adjusted = logits.clone()
        for row, s in enumerate(samplers):
            if _modifies(s.params):
                _apply_bias_and_penalties(adjusted[row], s)
    if masked:
        vocab = logits.shape[-1]
        keep = np.stack([allowed_mask(allowed[row], vocab) for row in masked])  # type: ignore[arg-type]
        keep_rows = torch.from_numpy(keep).to(logits.device)
        adjusted[masked] = adjusted[masked].masked_fill(~keep_rows, float("-inf"))
    chosen = torch.empty(rows, dtype=torch.int64, device=logits.device)
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy]
    if greedy:
        chosen[greedy] = adjusted[greedy].argmax(dim=-1)
    drawn = [i for i, s in enumerate(samplers) if not s.params.is_greedy]
    if drawn:
        chosen[drawn] = _draw(adjusted[drawn], [samplers[i] for i in drawn])
    token_ids = chosen.tolist()
    for row, s in enumerate(samplers):
        if s.output_counts is not None:
            s.output_counts[token_ids[row]] += 1
        if s.seen is not None:
            s.seen[token_ids[row]] = True
    return [
        _with_logprobs(token_ids[row], raw_logprobs, row, s.params.logprobs)
        for row, s in enumerate(samplers)
    ]


def _plain_greedy(s: SequenceSampler) -> bool:
    p = s.params
    return p.is_greedy and p.logprobs is None and not _modifies(p)


def _modifies(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.has_penalties


def _apply_bias_and_penalties(row: torch.Tensor, s: SequenceSampler) -> None:
    if s.bias_ids is not None and s.bias_values is not None:
        row.index_add_(0, s.bias_ids, s.bias_values)
    p = s.params
    if s.seen is not None:
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(s.seen, penalised, row))
    if s.output_counts is not None:
        row -= p.frequency_penalty * s.output_counts
        row -= p.presence_penalty * (s.output_counts > 0).float()


def _draw(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([s.params.temperature for s in samplers], device=device)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    uniforms = torch.cat(
        [torch.rand(1, generator=s.generator, device=device) for s in samplers]
    ).to(probs.dtype)
    choices = torch.empty(len(samplers), dtype=torch.int64, device=device)
    filtered = [i for i, s in enumerate(samplers) if _filters(s.params)]
    plain = [i for i, s in enumerate(samplers) if not _filters(s.params)]
    if plain:
        cdf = probs[plain].cumsum(dim=-1)
        target = uniforms[plain, None] * cdf[:, -1:]
        picked = torch.searchsorted(cdf, target).squeeze(-1)
        choices[plain] = picked.clamp_(max=probs.shape[-1] - 1)
    for i in filtered:
        choices[i] = _draw_filtered(probs[i], uniforms[i], samplers[i].params)
    return choices


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _draw_filtered(probs: torch.Tensor, uniform: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        keep &= before < p.top_p
    if p.min_p > 0.0:
        keep &= sorted_probs >= p.min_p * sorted_probs[0]
    keep[0] = True
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = kept.cumsum(0)
    index = torch.searchsorted(cdf, uniform * cdf[-1:]).clamp_(max=probs.shape[0] - 1)
    return order[index].squeeze(0)


def _with_logprobs(
    token_id: int, raw: torch.Tensor | None, row: int, top: int | None
) -> SampledToken:
    if raw is None or top is None:
        return SampledToken(token_id)
    logprobs = raw[row]
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = logprobs.topk(top)
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token_id, float(logprobs[token_id]), best)
