"""Turns sampled tokens into text deltas and finish decisions (SPEC E5, E6)."""

from __future__ import annotations

from collections.abc import Set

from slotserve.engine.outputs import FinishReason, SampledToken, SequenceDelta
from slotserve.engine.request import Sequence


def append_token(seq: Sequence, sampled: SampledToken, eog_token_ids: Set[int]) -> None:
    """Appends a sampled token to ``seq`` and decides whether the sequence has finished.

    Order of checks: stop token ids, end-of-generation tokens (unless ``ignore_eos``), stop
    strings (the text is cut where the stop string starts), then the length limit. Stop and
    end-of-generation tokens are counted as output tokens but contribute no text.
    """
    params = seq.request.params
    token_id = sampled.token_id
    seq.token_ids.append(token_id)
    seq.pending_tokens.append(token_id)
    if params.logprobs is not None:
        seq.pending_logprobs.append(sampled)

    reason: FinishReason | None = None
    if token_id in params.stop_token_ids:
        reason, seq.stop_reason = "stop", token_id
    elif token_id in eog_token_ids and not params.ignore_eos:
        reason = "stop"
    else:
        seq.detokenizer.add_token(token_id)
        if seq.detokenizer.matched_stop is not None:
            reason, seq.stop_reason = "stop", seq.detokenizer.matched_stop
    if reason is None and seq.num_output_tokens >= seq.max_tokens:
        reason = "length"
    seq.finish_reason = reason


def take_delta(seq: Sequence) -> SequenceDelta:
    """Drains what ``seq`` produced since the last delta; text held back for stop strings stays."""
    final = seq.finish_reason is not None
    text = "" if seq.finish_reason in ("abort", "error") else seq.detokenizer.take_delta(final)
    delta = SequenceDelta(
        index=seq.index,
        text=text,
        token_ids=seq.pending_tokens,
        logprobs=seq.pending_logprobs if seq.request.params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    seq.pending_tokens = []
    seq.pending_logprobs = []
    return delta
