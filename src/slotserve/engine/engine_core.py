"""The step loop's body: ``schedule → runner.execute → update_from_output`` (SPEC E2, E3, E7,
E10, E11).

Thread model: :meth:`EngineCore.add_request` and :meth:`EngineCore.abort_request` may be called
from any thread (they only touch the locked inbox). Everything else runs on the one engine
thread that calls :meth:`step`, which owns the scheduler, the slots and the runner.

A failure of ``runner.execute`` (an exception, or ``RunnerFailure`` for non-finite logits)
poisons the engine: every request still in it ends with an error, :attr:`EngineCore.unhealthy`
says why, and the engine does no further work. Recovery is a new runner and a new engine
(the server's reload).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence as SequenceOf

from slotserve.engine.config import EngineConfig
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.errors import EngineDeadError, QueueFullError
from slotserve.engine.limits import check_request
from slotserve.engine.output_processor import append_token, take_delta
from slotserve.engine.outputs import FinishReason, RequestOutput, SampledToken
from slotserve.engine.prefix_cache import PrefixCache, PrefixCacheStats
from slotserve.engine.request import Request, Sequence
from slotserve.engine.runner_interface import ModelInfo, Runner, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.engine.scheduler import Scheduler
from slotserve.engine.slots import SlotState
from slotserve.engine.stats import EngineStats, SlotSnapshot

logger = logging.getLogger(__name__)

# Slot states whose KV belongs to a running sequence (PREEMPTED ones gave theirs back).
_HOLDS_KV = (SlotState.PREFILLING, SlotState.GENERATING, SlotState.DRAINING)


class EngineCore:
    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        info = runner.model_info
        if info.num_slots < config.num_slots:
            raise ValueError(f"runner has {info.num_slots} slots, engine wants {config.num_slots}")
        if info.kv_capacity < info.max_seq_len:
            raise ValueError(
                f"the runner's KV holds {info.kv_capacity} tokens, less than one sequence "
                f"({info.max_seq_len}): a request could never finish"
            )
        self.runner = runner
        self.config = config
        self.model_info = info
        for slot in range(config.num_slots):  # the engine starts from empty KV in every slot
            runner.trim_kv(slot, 0)
        self.prefix_cache, disabled_reason = _build_prefix_cache(runner, config, info)
        self.scheduler = Scheduler(
            config,
            runner,
            equal_prefill_chunks=info.equal_prefill_chunks,
            prefill_grain=info.prefill_grain,
            prefix_cache=self.prefix_cache,
        )
        self.stats = EngineStats(
            prefix_cache=PrefixCacheStats(False, disabled_reason),
            kv_capacity_tokens=info.kv_capacity,
        )
        self.unhealthy: str | None = None  # why the engine was poisoned (SPEC E11)
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live: dict[str, Request] = {}  # engine thread only
        self._stopping = False
        self._publish_snapshot()

    # ---- any thread -------------------------------------------------------------------------

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validates a request against the model's limits; raises ``InvalidRequestError``."""
        room = check_request(self.model_info, self.config, prompt_token_ids, params)
        if params.structured_output is not None:
            self.runner.check_structured_output(params.structured_output)
        request = Request(request_id, list(prompt_token_ids), params)
        if self.config.request_timeout_s is not None:
            request.deadline = request.arrival_time + self.config.request_timeout_s
        token_bytes = self.runner.tokenizer.token_bytes
        for index in range(params.n):
            request.sequences.append(
                Sequence(
                    request=request,
                    index=index,
                    max_tokens=params.max_tokens or room,
                    detokenizer=IncrementalDetokenizer(token_bytes, params.stop),
                    token_ids=list(prompt_token_ids),
                    num_prompt_tokens=len(prompt_token_ids),
                )
            )
        return request

    def add_request(self, request: Request) -> None:
        """Queues a request for admission; raises ``QueueFullError`` at once when full and
        ``EngineDeadError`` when the engine was poisoned."""
        with self._lock:
            if self.unhealthy is not None:
                raise EngineDeadError(self.unhealthy)
            free = sum(1 for s in self.stats.slots if s.state == "free")
            waiting = len(self._inbox) + self.stats.num_waiting
            if waiting - free >= self.config.max_queue:
                raise QueueFullError(self.config.max_queue)
            self._inbox.append(request)
            self.stats.requests_submitted += 1
            self._work_ready.notify()

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._work_ready.notify()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Blocks the engine thread until there is something to do; False when stopping."""
        with self._lock:
            while not (self._inbox or self._aborts or self.scheduler.has_work or self._stopping):
                if not self._work_ready.wait(timeout):
                    break
            return not self._stopping

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work_ready.notify_all()

    # ---- engine thread ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step and returns what each touched request produced."""
        if self.unhealthy is not None:
            return self.fail_all(self.unhealthy)
        started = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        self._take_inbox(outputs)
        self._expire_deadlines(outputs)
        self._release_drained()
        self._admit(outputs)
        chunks = self.scheduler.schedule()
        if chunks:
            execute_started = time.perf_counter()
            try:
                sampled = self.runner.execute(chunks)
            except Exception as exc:
                logger.exception("runner.execute failed: the model is now unhealthy")
                self._poison(f"runner failure: {type(exc).__name__}: {exc}", outputs)
                return self._stamp(outputs)
            self.stats.execute_seconds += time.perf_counter() - execute_started
            self._update_from_output(chunks, sampled, outputs)
            self.stats.batch_tokens += sum(len(c.token_ids) for c in chunks)
            self._release_drained()
            self.stats.steps += 1
            elapsed = time.perf_counter() - started
            self.stats.step_seconds += elapsed
            if elapsed > self.config.slow_step_warn_s:
                request_ids = ",".join(sorted({self._request_id_of(c.slot) for c in chunks}))
                logger.warning(
                    "slow step: %.2f s for %d chunks, %d tokens (requests %s)",
                    elapsed,
                    len(chunks),
                    sum(len(c.token_ids) for c in chunks),
                    request_ids,
                    extra={"request_id": request_ids},
                )
        self._publish_snapshot()
        return self._stamp(outputs)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every live request with an error (used when the loop itself breaks)."""
        outputs: dict[str, RequestOutput] = {}
        with self._lock:
            pending, self._inbox = self._inbox, []
        for request in [*pending, *self._live.values()]:
            self._end_request(request, "error", outputs, error=message)
        self._release_drained(quietly=True)
        self._publish_snapshot()
        return self._stamp(outputs)

    def _poison(self, reason: str, outputs: dict[str, RequestOutput]) -> None:
        with self._lock:
            self.unhealthy = reason
            pending, self._inbox = self._inbox, []
        for request in [*pending, *self._live.values()]:
            self._end_request(request, "error", outputs, error=reason)
        self._release_drained(quietly=True)
        self._publish_snapshot()

    def _take_inbox(self, outputs: dict[str, RequestOutput]) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request in new:
            self._live[request.request_id] = request
            self.scheduler.waiting.append(request)
        for request_id in aborts:
            aborted = self._live.get(request_id)
            if aborted is not None:
                self.stats.requests_aborted += 1
                self._end_request(aborted, "abort", outputs)

    def _expire_deadlines(self, outputs: dict[str, RequestOutput]) -> None:
        if self.config.request_timeout_s is None:
            return
        now = time.monotonic()
        expired = [r for r in self._live.values() if r.deadline is not None and r.deadline < now]
        for request in expired:
            self.stats.requests_timed_out += 1
            self._end_request(request, "abort", outputs)
            outputs[request.request_id].timed_out = True

    def _admit(self, outputs: dict[str, RequestOutput]) -> None:
        now = time.monotonic()
        for seq in self.scheduler.admit():
            request = seq.request
            if request.admitted_time is None:
                request.admitted_time = now
                wait = now - request.arrival_time
                self.stats.queue_wait_seconds += wait
                self.stats.requests_admitted += 1
                log = logger.warning if wait > self.config.slow_queue_warn_s else logger.debug
                log(
                    "request %s admitted after %.1f ms queued",
                    request.request_id,
                    wait * 1000,
                    extra={"request_id": request.request_id},
                )
            if seq.finish_reason is not None:
                continue  # a sibling failed to start
            assert seq.slot is not None
            params = request.params
            seed = None if params.seed is None else params.seed + seq.index
            try:
                self.runner.add_sequence(seq.slot, params, seq.token_ids, seed)
            except Exception as exc:
                logger.exception(
                    "request %s: runner.add_sequence failed",
                    request.request_id,
                    extra={"request_id": request.request_id},
                )
                self._end_request(request, "error", outputs, error=str(exc))

    def _update_from_output(
        self,
        chunks: SequenceOf[ScheduledChunk],
        sampled: dict[int, SampledToken],
        outputs: dict[str, RequestOutput],
    ) -> None:
        eog = self.model_info.eog_token_ids
        for chunk in chunks:
            seq = self.scheduler.on_chunk_computed(chunk)
            if not chunk.sample:
                continue
            if seq.num_output_tokens == 0:
                self.stats.prompt_tokens += seq.num_prompt_tokens
            append_token(seq, sampled[chunk.slot], eog)
            self.stats.generated_tokens += 1
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            self._emit(seq, outputs)

    def _emit(self, seq: Sequence, outputs: dict[str, RequestOutput]) -> None:
        request = seq.request
        out = self._output_for(request, outputs)
        out.deltas.append(take_delta(seq))
        out.num_output_tokens = request.num_output_tokens
        if request.finished:
            out.finished = True
            self._live.pop(request.request_id, None)
            self.stats.requests_finished += 1
            _log_end(request, "finished")

    def _end_request(
        self,
        request: Request,
        reason: FinishReason,
        outputs: dict[str, RequestOutput],
        error: str | None = None,
    ) -> None:
        """Finishes every unfinished sequence of ``request`` (abort or error) and emits it,
        one delta per sequence ended here carrying the finish reason."""
        self.scheduler.remove_waiting(request)
        self._live.pop(request.request_id, None)
        out = self._output_for(request, outputs)
        for seq in request.sequences:
            if seq.finish_reason is not None:
                continue
            seq.finish_reason = reason
            if seq.slot is not None:
                self.scheduler.finish(seq)
            out.deltas.append(take_delta(seq))
        out.finished = True
        out.error = error
        out.num_output_tokens = request.num_output_tokens
        if error is not None:
            self.stats.requests_failed += 1
        _log_end(request, "failed" if error is not None else "aborted", error)

    def _output_for(self, request: Request, outputs: dict[str, RequestOutput]) -> RequestOutput:
        out = outputs.get(request.request_id)
        if out is None:
            out = outputs[request.request_id] = RequestOutput(
                request.request_id,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=request.sequences[0].num_cached_tokens,
                arrival_time=request.arrival_time,
                queue_seconds=(
                    None
                    if request.admitted_time is None
                    else request.admitted_time - request.arrival_time
                ),
            )
        return out

    @staticmethod
    def _stamp(outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        now = time.monotonic()
        for out in outputs.values():
            out.time = now
        return list(outputs.values())

    def _release_drained(self, quietly: bool = False) -> None:
        """Releases DRAINING slots. ``quietly``: after a runner failure the runner may fail
        again; the slots are freed anyway (the engine is being given up)."""
        for slot in self.scheduler.drained_slots():
            try:
                self.runner.remove_sequence(slot.index)
                if self.prefix_cache is None:
                    self.runner.trim_kv(slot.index, 0)
            except Exception:
                if not quietly:
                    raise
                logger.warning("could not free slot %d after the runner failed", slot.index)
            finally:
                try:
                    self.scheduler.release(slot)
                except Exception:
                    if not quietly:
                        raise

    def _request_id_of(self, slot: int) -> str:
        seq = self.scheduler.slots.slots[slot].sequence
        return seq.request.request_id if seq is not None else "?"

    @property
    def is_idle(self) -> bool:
        """Nothing queued, running or waiting to be taken from the inbox (engine thread)."""
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return not pending and not self.scheduler.has_work

    def check_integrity_when_idle(self) -> None:
        """Runs :meth:`check_integrity`, counting and logging a failure instead of raising."""
        self.stats.integrity_checks += 1
        try:
            self.check_integrity()
        except (AssertionError, RuntimeError) as exc:  # the runner's kv_tokens raises too
            self.stats.integrity_failures += 1
            self.stats.last_integrity_error = str(exc)
            logger.error("KV integrity check failed: %s", exc)

    def check_integrity(self) -> None:
        """Engine thread, between steps. Raises ``AssertionError`` when slot, cache and runner
        KV bookkeeping disagree: every slot's KV must be what its sequence computed (running),
        what the prefix cache says it holds (free or preempted, cache on), or nothing (cache
        off)."""
        running = {
            slot.index: slot.sequence.num_computed_tokens
            for slot in self.scheduler.slots.slots
            if slot.sequence is not None and slot.state in _HOLDS_KV
        }
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(running)
            return
        for slot in self.scheduler.slots.slots:
            held = self.runner.kv_tokens(slot.index)
            expected = running.get(slot.index, 0)
            assert held == expected, f"slot {slot.index} KV holds {held}, expected {expected}"

    def _publish_snapshot(self) -> None:
        snapshot = []
        running_requests: set[str] = set()
        kv_slots: list[int] = []
        for slot in self.scheduler.slots.slots:
            seq = slot.sequence
            snapshot.append(
                SlotSnapshot(
                    index=slot.index,
                    state=slot.state.value,
                    request_id=seq.request.request_id if seq else None,
                    num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                    num_computed_tokens=seq.num_computed_tokens if seq else 0,
                    num_output_tokens=seq.num_output_tokens if seq else 0,
                )
            )
            if seq is not None and slot.state in _HOLDS_KV:
                kv_slots.append(slot.index)
                running_requests.add(seq.request.request_id)
        stats = self.stats
        stats.slots = tuple(snapshot)
        stats.num_running = len(running_requests)
        stats.num_waiting = len(self.scheduler.waiting) + sum(
            1 for s in snapshot if s.state == SlotState.PREEMPTED.value
        )
        stats.preemptions = self.scheduler.num_preemptions
        if self.unhealthy is None:
            stats.kv_used_tokens = self.runner.kv_used_tokens(kv_slots) if kv_slots else 0
        if self.prefix_cache is not None:
            stats.prefix_cache = self.prefix_cache.stats()


def _build_prefix_cache(
    runner: Runner, config: EngineConfig, info: ModelInfo
) -> tuple[PrefixCache | None, str | None]:
    """The prefix cache, or None with the reason it is off (logged)."""
    if not config.prefix_cache:
        return None, "disabled by configuration (--no-prefix-cache)"
    if info.prefix_cache_unsupported is not None:
        logger.warning("prefix cache disabled: %s", info.prefix_cache_unsupported)
        return None, info.prefix_cache_unsupported
    budget = config.num_slots * info.max_seq_len  # everything free slots can hold
    if config.prefix_cache_budget_tokens is not None:
        budget = min(budget, config.prefix_cache_budget_tokens)
    if config.prefix_cache_budget_bytes is not None and info.kv_bytes_per_token > 0:
        budget = min(budget, config.prefix_cache_budget_bytes // info.kv_bytes_per_token)
    logger.info(
        "prefix cache on: budget %d tokens (%.1f MiB of KV)",
        budget,
        budget * info.kv_bytes_per_token / 2**20,
    )
    cache = PrefixCache(
        runner, config.num_slots, budget, info.kv_bytes_per_token, grain=info.prefill_grain
    )
    return cache, None


def _log_end(request: Request, how: str, error: str | None = None) -> None:
    now = time.monotonic()
    queued = (request.admitted_time or now) - request.arrival_time
    logger.info(
        "request %s %s: %d prompt (%d cached) + %d output tokens, %.0f ms queued, %.0f ms in all%s",
        request.request_id,
        how,
        len(request.prompt_token_ids),
        request.sequences[0].num_cached_tokens if request.sequences else 0,
        request.num_output_tokens,
        queued * 1000,
        (now - request.arrival_time) * 1000,
        f" ({error})" if error else "",
        extra={"request_id": request.request_id},
    )
