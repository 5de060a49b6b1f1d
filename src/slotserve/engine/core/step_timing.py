"""How long a step and its parts take, counted into the engine's counters: the forward pass
and the prompt tokens' share of it, the step's own time (image encodes left out: they are
measured against it, ``encoder_work.py``), the whole step, and a warning for a slow one."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceOf

from slotserve.engine.core.slots import Slot, SlotPool
from slotserve.engine.core.stats import EngineCounters
from slotserve.engine.runner_interface import ScheduledChunk

logger = logging.getLogger(__name__)


def prompt_tokens_in(chunks: SequenceOf[ScheduledChunk], slots: SlotPool) -> int:
    """How many of the chunks' tokens are prompt positions (a resumed sequence's
    recomputed output counts as decode work)."""
    count = 0
    for chunk in chunks:
        if (seq := slots.sequence_in(chunk.slot)) is not None:
            end = min(chunk.start_pos + len(chunk.token_ids), seq.num_prompt_tokens)
            count += max(0, end - chunk.start_pos)
    return count


class StepTimer:
    """Engine thread only; one step at a time: :meth:`start`, :meth:`own_work_starts`,
    :meth:`executed`, :meth:`step_done` (a step that ran no batch stops after the second)."""

    def __init__(self, counters: EngineCounters, slow_step_warn_s: float) -> None:
        self.counters = counters
        self.slow_step_warn_s = slow_step_warn_s
        self.last_step_seconds = 0.0  # the last step's own time, image encodes left out
        self._started = self._own_start = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def own_work_starts(self) -> None:
        """The step's own time starts here: what ran before (encodes) is measured apart."""
        self._own_start = time.perf_counter()

    def executed(
        self, chunks: SequenceOf[ScheduledChunk], seconds: float, prompt_tokens: int
    ) -> None:
        """The forward pass over ``chunks`` took ``seconds``; ``prompt_tokens`` of its tokens
        were prompt positions, whose share of the time counts as prompt computing."""
        counters = self.counters
        counters.execute_seconds += seconds
        if prompt_tokens:
            step_tokens = sum(len(chunk.token_ids) for chunk in chunks)
            counters.prompt_computed_tokens += prompt_tokens
            counters.prompt_compute_seconds += seconds * prompt_tokens / step_tokens

    def step_done(self, slots: SequenceOf[Slot], chunks: SequenceOf[ScheduledChunk]) -> None:
        """Counts a step that ran its batch, and warns when it was slow."""
        now = time.perf_counter()
        self.counters.steps += 1
        self.last_step_seconds = now - self._own_start
        elapsed = now - self._started
        self.counters.step_seconds += elapsed
        if elapsed > self.slow_step_warn_s:
            warn_slow_step(slots, chunks, elapsed)


def warn_slow_step(
    slots: SequenceOf[Slot], chunks: SequenceOf[ScheduledChunk], elapsed: float
) -> None:
    request_ids = ",".join(
        sorted({s.request.request_id for c in chunks if (s := slots[c.slot].sequence)})
    )
    logger.warning(
        "slow step: %.2f s for %d chunks, %d tokens (requests %s)",
        elapsed,
        len(chunks),
        sum(len(c.token_ids) for c in chunks),
        request_ids,
        extra={"request_id": request_ids},
    )
