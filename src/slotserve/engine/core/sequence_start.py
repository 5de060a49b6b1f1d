"""The runner's side of admission: a sequence the scheduler placed in a slot starts there, with
its sampler state (``Runner.add_sequence``), its grammar matcher (structured output) and its
images. A sequence that cannot start fails its request alone."""

from __future__ import annotations

import logging
import time

from slotserve.engine.core.encoder_work import EncoderWork
from slotserve.engine.core.live_requests import LiveRequests
from slotserve.engine.core.output_processor import Outputs, log_admitted
from slotserve.engine.decoding.structured_output import GrammarMasks
from slotserve.engine.outputs import FailureKind
from slotserve.engine.request import Sequence
from slotserve.engine.runner_interface import Runner

logger = logging.getLogger(__name__)


class SequenceStarter:
    """Engine thread only. ``slow_queue_warn_s``: a request that waited longer to be admitted
    is logged as a warning."""

    def __init__(
        self,
        runner: Runner,
        grammars: GrammarMasks,
        encoder: EncoderWork | None,
        requests: LiveRequests,
        slow_queue_warn_s: float,
    ) -> None:
        self.runner, self.grammars, self.encoder = runner, grammars, encoder
        self.requests, self.slow_queue_warn_s = requests, slow_queue_warn_s

    def start(self, placed: list[Sequence], outputs: Outputs) -> None:
        """Starts newly placed sequences; a failed start's error goes into ``outputs``."""
        now = time.monotonic()
        for seq in placed:
            request = seq.request
            if request.admitted_time is None:
                request.admitted_time = now
                log_admitted(request, self.slow_queue_warn_s)
            if seq.finish_reason is not None:
                continue  # a sibling failed to start
            assert seq.slot is not None
            submitted = request.submitted
            params = submitted.params
            seed = None if params.seed is None else params.seed + seq.index
            try:
                if params.structured_output is not None and seq.grammar is None:
                    seq.grammar = self.grammars.matcher(params.structured_output)
                if submitted.images:
                    assert self.encoder is not None, "validated: the model reads images"
                    self.encoder.add(seq.slot, submitted.images)
                self.runner.add_sequence(seq.slot, params, seq.token_ids, seed)
            except Exception as exc:
                logger.exception(
                    "request %s: runner.add_sequence failed",
                    request.request_id,
                    extra={"request_id": request.request_id},
                )
                failure = FailureKind.REQUEST_FAILED
                self.requests.end(request, "error", outputs, error=str(exc), failure=failure)
