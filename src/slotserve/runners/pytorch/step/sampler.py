"""Batched sampling on the device, one row per sequence that needs a token.

Order, as vLLM applies it: logit bias → penalties → structured-output mask → (greedy: argmax)
→ temperature → top-k → top-p → min-p → draw; the penalties are ``penalties.py``'s.
Log-probabilities come from the raw logits, before any of this.

Every stage is one batched operation over the rows that need it (a row's parameters gathered
into tensors), not a loop over rows: a GPU launches a handful of kernels per step whatever the
batch, and the results come back in one copy. The draw is an inverse-CDF lookup of one uniform
number: from the sequence's own generator when it has a seed (``seed + choice index``), so a
seeded sequence draws the same tokens alone or batched; unseeded rows share one draw. Every
row's arithmetic is its own (row-wise softmax, top-k or sort, and scans).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotserve.engine.decoding.structured_output import allowed_mask
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.step.penalties import Penalties, apply_penalties

PREFIX_TOKENS = 1024  # the most likely tokens a filtered draw orders before the whole row


@dataclass
class SequenceSampler:
    """Per-slot sampling state."""

    params: SamplingParams
    generator: torch.Generator | None  # a seeded sequence's own stream; None: the shared one
    penalties: Penalties | None
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None


def new_sequence_sampler(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    seed: int | None,
    device: torch.device,
) -> SequenceSampler:
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed % (2**63))
    bias_ids = bias_values = None
    if params.logit_bias:
        bias_ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        bias_values = torch.tensor([b for _, b in params.logit_bias], device=device)
    penalties = Penalties.of(params, prompt_token_ids, device)
    return SequenceSampler(params, generator, penalties, bias_ids, bias_values)


def sample(
    logits: torch.Tensor,
    samplers: Sequence[SequenceSampler],
    allowed: Sequence[np.ndarray[Any, Any] | None] = (),
) -> list[SampledToken]:
    """``logits``: float32 [rows, vocab], row ``i`` for ``samplers[i]``; ``allowed[i]``, when
    given and not None, is row ``i``'s structured-output bitmask (``ScheduledChunk``)."""
    masked = [row for row, mask in enumerate(allowed) if mask is not None]
    if not masked and all(_plain_greedy(s) for s in samplers):
        return [SampledToken(t) for t in _first_largest(logits).tolist()]
    device = logits.device
    adjusted = logits
    if masked or any(_modifies(s.params) for s in samplers):
        adjusted = logits.clone()
        _apply_bias(adjusted, samplers)
        apply_penalties(adjusted, [s.penalties for s in samplers])
    if masked:
        vocab = logits.shape[-1]
        keep = np.stack([allowed_mask(allowed[row], vocab) for row in masked])  # type: ignore[arg-type]
        keep_rows = torch.from_numpy(keep).to(device)
        adjusted[masked] = adjusted[masked].masked_fill(~keep_rows, float("-inf"))
    drawn = [i for i, s in enumerate(samplers) if not s.params.is_greedy]
    if len(drawn) == len(samplers):
        chosen = _draw(adjusted, samplers)
    else:
        chosen = _first_largest(adjusted)
        if drawn:
            chosen[drawn] = _draw(adjusted[drawn], [samplers[i] for i in drawn])
    token_ids = chosen.tolist()
    _count(samplers, token_ids)
    return _with_logprobs(logits, samplers, token_ids)


def _first_largest(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the index of its first largest value (a NaN counting as the largest),
    as torch gives it. On the CPU through numpy, whose reduction is vectorized where torch's
    CPU argmax walks each row element by element: a greedy step's largest cost past the
    forward at many rows."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample_chunks(
    chunks: Sequence[ScheduledChunk],
    logits: torch.Tensor,
    samplers: Mapping[int, SequenceSampler],
) -> dict[int, list[SampledToken]]:
    """Samples each chunk's rows of ``logits`` (``num_drafts + 1`` per chunk, in order) with
    its slot's sampler, position by position, each sequence stopping at its first sample that
    differs from the draft after it: a sequence's sampler sees exactly the tokens it produces."""
    if not any(chunk.num_drafts for chunk in chunks):  # no drafts: one row each, no copy
        chosen = [samplers[chunk.slot] for chunk in chunks]
        tokens = sample(logits, chosen, [chunk.allowed_tokens for chunk in chunks])
        return {chunk.slot: [token] for chunk, token in zip(chunks, tokens, strict=True)}
    firsts, row = [], 0
    for chunk in chunks:
        firsts.append(row)
        row += chunk.num_drafts + 1
    result: dict[int, list[SampledToken]] = {chunk.slot: [] for chunk in chunks}
    alive = list(range(len(chunks)))
    depth = 0
    while alive:
        rows = torch.tensor([firsts[i] + depth for i in alive], device=logits.device)
        chosen = [samplers[chunks[i].slot] for i in alive]
        still = []
        # Constrained sequences are never drafted: their one mask is at depth 0.
        allowed = [chunks[i].allowed_tokens if depth == 0 else None for i in alive]
        for i, token in zip(alive, sample(logits[rows], chosen, allowed), strict=True):
            chunk = chunks[i]
            result[chunk.slot].append(token)
            draft_at = len(chunk.token_ids) - chunk.num_drafts + depth
            if depth < chunk.num_drafts and token.token_id == chunk.token_ids[draft_at]:
                still.append(i)
        alive, depth = still, depth + 1
    return result


def _plain_greedy(s: SequenceSampler) -> bool:
    p = s.params
    return p.is_greedy and p.logprobs is None and not _modifies(p)


def _modifies(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.has_penalties


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _apply_bias(adjusted: torch.Tensor, samplers: Sequence[SequenceSampler]) -> None:
    biased = [(row, s) for row, s in enumerate(samplers) if s.bias_ids is not None]
    if not biased:
        return
    rows = torch.cat([torch.full_like(s.bias_ids, row) for row, s in biased])  # type: ignore[arg-type]
    ids = torch.cat([s.bias_ids for _, s in biased])  # type: ignore[misc]
    values = torch.cat([s.bias_values for _, s in biased])  # type: ignore[misc]
    adjusted.index_put_((rows, ids), values.to(adjusted.dtype), accumulate=True)


def _uniforms(samplers: Sequence[SequenceSampler], device: torch.device) -> torch.Tensor:
    """One uniform number per row: a seeded sequence's from its own generator (in row order,
    so several rows of one sequence draw in turn), the others' in one shared draw."""
    uniforms = torch.empty(len(samplers), dtype=torch.float32, device=device)
    shared = [i for i, s in enumerate(samplers) if s.generator is None]
    if shared:
        uniforms[shared] = torch.rand(len(shared), device=device)
    for i, s in enumerate(samplers):
        if s.generator is not None:
            uniforms[i] = torch.rand(1, generator=s.generator, device=device)[0]
    return uniforms


def _draw(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    device = logits.device
    temperature = _column([s.params.temperature for s in samplers], device)
    probs = torch.softmax(logits / temperature, dim=-1)
    uniforms = _uniforms(samplers, device).to(probs.dtype)
    vocab = probs.shape[-1]
    choices = torch.empty(len(samplers), dtype=torch.int64, device=device)
    filtered = [i for i, s in enumerate(samplers) if _filters(s.params)]
    plain = [i for i, s in enumerate(samplers) if not _filters(s.params)]
    if plain:
        cdf = _rows(probs, plain).cumsum(dim=-1)
        target = uniforms[plain, None] * cdf[:, -1:]
        choices[plain] = torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=vocab - 1)
    if filtered:
        choices[filtered] = _draw_filtered(
            _rows(probs, filtered), uniforms[filtered], [samplers[i].params for i in filtered]
        )
    return choices


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without copying a batch's rows when they are all of them in order."""
    return t if rows == list(range(len(t))) else t[rows]


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _draw_filtered(
    probs: torch.Tensor, uniforms: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Top-k, then top-p, then min-p over each row's probabilities in descending order, the
    row's most likely token always kept; then the inverse-CDF draw over what is kept.

    Sorting a whole vocabulary costs milliseconds a row, while the filters keep a few tokens:
    a row first orders only its ``top_k`` most likely tokens (``PREFIX_TOKENS`` without one),
    and only where its filters would keep tokens past those is the whole row sorted. Either way
    the kept tokens, their order and the sums over them are the same, so the draw is too
    (tokens of equal probability aside, which either order may take first); how far a row
    looks depends on its own parameters and probabilities alone, never on its batch."""
    vocab = probs.shape[-1]
    choices = torch.empty(len(params), dtype=torch.int64, device=probs.device)
    widths: dict[int, list[int]] = {}
    for row, p in enumerate(params):
        width = p.top_k if 0 < p.top_k < PREFIX_TOKENS else PREFIX_TOKENS
        widths.setdefault(min(width, vocab), []).append(row)
    unsorted: list[int] = []
    for width, rows in widths.items():
        top_probs, order = _rows(probs, rows).topk(width, dim=-1)
        chosen, settled = _draw_ordered(top_probs, order, uniforms[rows], [params[r] for r in rows])
        done = [i for i, ok in enumerate(settled.tolist()) if ok or width == vocab]
        if done:
            choices[[rows[i] for i in done]] = chosen[done]
        unsorted += [row for i, row in enumerate(rows) if i not in done]
    if unsorted:
        sorted_probs, order = probs[unsorted].sort(dim=-1, descending=True)
        choices[unsorted], _ = _draw_ordered(
            sorted_probs, order, uniforms[unsorted], [params[r] for r in unsorted]
        )
    return choices


def _draw_ordered(
    sorted_probs: torch.Tensor,
    order: torch.Tensor,
    uniforms: torch.Tensor,
    params: Sequence[SamplingParams],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draws over each row's most likely tokens in descending order (``sorted_probs``,
    their ids ``order``), and whether that settles the row: its filters drop every less likely
    token (its ``top_k`` is within them, or they drop the last one, and each filter that drops
    a token drops every less likely one), so the draw is the whole vocabulary's."""
    device = sorted_probs.device
    width = sorted_probs.shape[-1]
    # top_k 0 and -1 both keep every token.
    top_k = torch.tensor([p.top_k if p.top_k > 0 else 2**62 for p in params], device=device)
    keep = torch.arange(width, device=device)[None, :] < top_k[:, None]
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
    keep &= before < _column([p.top_p for p in params], device)
    keep &= sorted_probs >= _column([p.min_p for p in params], device) * sorted_probs[:, :1]
    settled = ~keep[:, -1] | (top_k <= width)
    keep[:, 0] = True
    cdf = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).cumsum(dim=-1)
    index = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:]).clamp_(max=width - 1)
    return order.gather(1, index).squeeze(-1), settled


def _count(samplers: Sequence[SequenceSampler], token_ids: list[int]) -> None:
    """The penalties' state takes each sampled token."""
    for s, token in zip(samplers, token_ids, strict=True):
        if s.penalties is not None:
            s.penalties.add(token)


def _with_logprobs(
    logits: torch.Tensor, samplers: Sequence[SequenceSampler], token_ids: list[int]
) -> list[SampledToken]:
    """Each sampled token with its log-probability and the top alternatives under the raw
    logits, where its request asks for them: one batched log-softmax and top-k, one copy."""
    asking = [row for row, s in enumerate(samplers) if s.params.logprobs is not None]
    if not asking:
        return [SampledToken(t) for t in token_ids]
    logprobs = torch.log_softmax(_rows(logits, asking), dim=-1)
    picked = logprobs.gather(
        1, torch.tensor([token_ids[r] for r in asking], device=logits.device)[:, None]
    )
    widest = max(samplers[r].params.logprobs or 0 for r in asking)
    values, ids = logprobs.topk(widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0])
    picked_list, value_rows, id_rows = picked[:, 0].tolist(), values.tolist(), ids.tolist()
    out = [SampledToken(t) for t in token_ids]
    for k, row in enumerate(asking):
        top = samplers[row].params.logprobs or 0
        best = tuple(zip(id_rows[k][:top], value_rows[k][:top], strict=True))
        out[row] = SampledToken(token_ids[row], float(picked_list[k]), best)
    return out
