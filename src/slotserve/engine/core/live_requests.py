"""The requests in the engine core, by id, and how each one ends: finished by its sequences,
aborted (its client left, its deadline passed, the engine stops) or failed. Every end puts the
request's last output into the step's outputs and writes its log line."""

from __future__ import annotations

import time

from slotserve.engine.core.output_processor import Outputs, log_end, output_for, take_delta
from slotserve.engine.core.scheduler import Scheduler
from slotserve.engine.core.stats import EngineCounters
from slotserve.engine.outputs import FailureKind, FinishReason
from slotserve.engine.request import Request, Sequence


class LiveRequests:
    """Engine thread only. ``timeout_s``: ``--request-timeout`` (None: requests have no
    deadline)."""

    def __init__(
        self, scheduler: Scheduler, counters: EngineCounters, timeout_s: float | None
    ) -> None:
        self.scheduler, self.counters, self.timeout_s = scheduler, counters, timeout_s
        self.by_id: dict[str, Request] = {}
        self._pending: Outputs = {}  # outputs of aborts, delivered by the next step

    def add(self, request: Request) -> None:
        """Queues ``request`` for admission (its id is not in the core: the caller checked)."""
        self.by_id[request.request_id] = request
        self.scheduler.waiting.append(request)
        self.counters.requests_submitted += 1

    def take_pending(self) -> Outputs:
        """The outputs made between steps (aborts, unloaded adapters), for the next step."""
        outputs, self._pending = self._pending, {}
        return outputs

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def abort(self, request_id: str) -> None:
        """Ends a request (its final output comes with the next step); unknown ids are ignored
        (the request may have finished meanwhile)."""
        request = self.by_id.get(request_id)
        if request is not None:
            self.counters.requests_aborted += 1
            self.end(request, "abort", self._pending)

    def fail_using_adapter(self, adapter_id: int, message: str) -> None:
        """Ends with an error, in the next step's outputs, every request on the adapter."""
        for request in [r for r in self.by_id.values() if r.submitted.adapter == adapter_id]:
            self.end(request, "error", self._pending, message, FailureKind.REQUEST_FAILED)

    def expire(self, outputs: Outputs) -> None:
        """Ends every request past its deadline."""
        if self.timeout_s is None:
            return
        now = time.monotonic()
        expired = [r for r in self.by_id.values() if r.deadline is not None and r.deadline < now]
        for request in expired:
            self.counters.requests_timed_out += 1
            self.end(request, "abort", outputs, failure=FailureKind.TIMED_OUT)

    def fail_all(self, message: str, kind: FailureKind, outputs: Outputs) -> None:
        """Ends every request with an error (the caller then frees their slots)."""
        for request in list(self.by_id.values()):
            self.end(request, "error", outputs, error=message, failure=kind)

    def emit(self, seq: Sequence, outputs: Outputs) -> None:
        """Puts what ``seq`` produced into its request's output; a request whose every
        sequence finished leaves the core."""
        request = seq.request
        out = output_for(request, outputs)
        out.deltas.append(take_delta(seq))
        out.num_output_tokens = request.num_output_tokens
        if request.finished:
            out.finished = True
            self.by_id.pop(request.request_id, None)
            self.counters.requests_finished += 1
            log_end(request, "finished")

    def end(
        self,
        request: Request,
        reason: FinishReason,
        outputs: Outputs,
        error: str | None = None,
        failure: FailureKind | None = None,
    ) -> None:
        """Finishes every unfinished sequence of ``request`` (abort or error) and emits it,
        one delta per sequence ended here carrying the finish reason."""
        self.scheduler.remove_waiting(request)
        self.by_id.pop(request.request_id, None)
        out = output_for(request, outputs)
        for seq in request.sequences:
            if seq.finish_reason is not None:
                continue
            seq.finish_reason = reason
            if seq.slot is not None:
                self.scheduler.finish(seq)
            out.deltas.append(take_delta(seq))
        out.finished = True
        out.error, out.failure = error, failure
        out.num_output_tokens = request.num_output_tokens
        if error is not None:
            self.counters.requests_failed += 1
        log_end(request, "failed" if error is not None else "aborted", error)
