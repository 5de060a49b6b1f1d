"""Turns sampled tokens into text deltas and finish decisions, and gathers a
step's deltas into one :class:`RequestOutput` per request."""

from __future__ import annotations

import logging
import time
from collections.abc import Set

from slotserve.engine.decoding.structured_output import advance_grammar
from slotserve.engine.outputs import FinishReason, RequestOutput, SampledToken, SequenceDelta
from slotserve.engine.request import Request, Sequence

logger = logging.getLogger(__name__)

Outputs = dict[str, RequestOutput]  # one step's outputs by request id


def append_token(seq: Sequence, sampled: SampledToken, eog_token_ids: Set[int]) -> None:
    """Appends a sampled token to ``seq`` and decides whether the sequence has finished.

    Order of checks: stop token ids, end-of-generation tokens (unless ``ignore_eos``), stop
    strings (the text is cut where the stop string starts), the end of the sequence's grammar
    (structured output), then the length limit. Stop and end-of-generation tokens are counted
    as output tokens but contribute no text.
    """
    params = seq.request.submitted.params
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
    if reason is None and seq.grammar is not None and advance_grammar(seq, token_id):
        reason = "stop"  # the grammar is complete: only the end could follow
    if reason is None and seq.num_output_tokens >= seq.max_tokens:
        reason = "length"
    seq.finish_reason = reason


def take_delta(seq: Sequence) -> SequenceDelta:
    """Drains what ``seq`` produced since the last delta; text held back for stop strings stays."""
    final = seq.finish_reason is not None
    text = "" if seq.finish_reason in ("abort", "error") else seq.detokenizer.take_delta(final)
    wants_logprobs = seq.request.submitted.params.logprobs is not None
    delta = SequenceDelta(
        index=seq.index,
        text=text,
        token_ids=seq.pending_tokens,
        logprobs=seq.pending_logprobs if wants_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
        delta.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
    seq.pending_tokens = []
    seq.pending_logprobs = []
    return delta


def output_for(request: Request, outputs: Outputs) -> RequestOutput:
    """The step's output of ``request``, created on first use."""
    out = outputs.get(request.request_id)
    if out is None:
        admitted, arrived = request.admitted_time, request.submitted.arrival_time
        out = outputs[request.request_id] = RequestOutput(
            request.request_id,
            num_prompt_tokens=len(request.submitted.prompt_token_ids),
            num_cached_tokens=request.sequences[0].num_cached_tokens,
            arrival_time=arrived,
            queue_seconds=None if admitted is None else admitted - arrived,
        )
    return out


def stamped(outputs: Outputs) -> list[RequestOutput]:
    """The outputs, each marked with the time the step made them."""
    now = time.monotonic()
    for out in outputs.values():
        out.time = now
    return list(outputs.values())


def log_admitted(request: Request, slow_queue_warn_s: float) -> None:
    wait = (request.admitted_time or time.monotonic()) - request.submitted.arrival_time
    log = logger.warning if wait > slow_queue_warn_s else logger.debug
    log(
        "request %s admitted after %.1f ms queued",
        request.request_id,
        wait * 1000,
        extra={"request_id": request.request_id},
    )


def log_end(request: Request, how: str, error: str | None = None) -> None:
    now = time.monotonic()
    arrived = request.submitted.arrival_time
    queued = (request.admitted_time or now) - arrived
    logger.info(
        "request %s %s: %d prompt (%d cached) + %d output tokens, %.0f ms queued, %.0f ms in all%s",
        request.request_id,
        how,
        len(request.submitted.prompt_token_ids),
        request.sequences[0].num_cached_tokens if request.sequences else 0,
        request.num_output_tokens,
        queued * 1000,
        (now - arrived) * 1000,
        f" ({error})" if error else "",
        extra={"request_id": request.request_id},
    )
