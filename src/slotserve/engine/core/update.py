"""The last stage of a step, ``update_from_output``: what the runner gave back for a batch
(:class:`ExecutedBatch`) moves each chunk's sequence on. A sequence advances by its chunk,
takes its prompt log-probabilities, its sampled tokens (a verification chunk's accepted
drafts and one more) or its embedding, and finishes where a token, its length limit or the end
of its prompt (an embedding) says so; each touched request gets its output for the step."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from slotserve.engine.core.live_requests import LiveRequests
from slotserve.engine.core.output_processor import Outputs, append_token, output_for
from slotserve.engine.core.scheduler import Scheduler
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ScheduledChunk


@dataclass(frozen=True)
class ExecutedBatch:
    """One batch and what the runner's forward pass over it gave back, by slot."""

    chunks: list[ScheduledChunk]
    sampled: dict[int, list[SampledToken]]
    prompt_logprobs: dict[int, list[SampledToken]]
    embeddings: dict[int, list[float]]


def update_from_output(
    batch: ExecutedBatch,
    scheduler: Scheduler,
    requests: LiveRequests,
    eog_token_ids: Set[int],
    outputs: Outputs,
) -> None:
    """Applies ``batch``'s results to its sequences; their outputs go into ``outputs``."""
    slots = scheduler.slots.slots
    for slot, scored in batch.prompt_logprobs.items():
        if (seq := slots[slot].sequence) is not None:
            seq.prompt_logprobs.extend(scored)
    for chunk in batch.chunks:
        seq = scheduler.on_chunk_computed(chunk)
        if chunk.embed_last:  # an embedding ends with its prompt (scheduler invariant 10)
            output_for(seq.request, outputs).embedding = batch.embeddings[chunk.slot]
            seq.finish_reason = "stop"
            scheduler.finish(seq)
            requests.emit(seq, outputs)
            continue
        if not chunk.sample:
            continue
        tokens = batch.sampled[chunk.slot]
        for token in tokens:  # a verification chunk's accepted drafts, then one more
            append_token(seq, token, eog_token_ids)
            requests.counters.generated_tokens += 1
            if seq.finish_reason is not None:
                break  # a stop inside an accepted run: the rest is not output
        if chunk.num_drafts:
            scheduler.settle_drafts(seq, chunk, len(tokens) - 1)
        if seq.finish_reason is not None:
            scheduler.finish(seq)
        requests.emit(seq, outputs)
