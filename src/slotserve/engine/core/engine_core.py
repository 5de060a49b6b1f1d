"""The engine core: ``schedule → runner.execute → update_from_output``. Its owner (an engine
client, ``engine/client/``) calls :meth:`EngineCore.add_request`, :meth:`~.abort`, :meth:`~.step`
and :meth:`~.snapshot` from one thread; the core has no lock, condition or thread.

A failure of ``runner.execute`` (an exception, or ``RunnerFailure`` for non-finite logits)
poisons the engine: every request still in it ends with an error of kind
``MODEL_UNHEALTHY``, :attr:`EngineCore.unhealthy` says why, and the engine does no further work.
Recovery is a new runner and a new engine (the server's reload).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import replace

from slotserve.engine.adapters import adapter_ids, load_adapter, unload_adapter
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.limits import validate_request
from slotserve.engine.core.output_processor import (
    Outputs,
    append_token,
    log_admitted,
    log_end,
    output_for,
    stamped,
    take_delta,
    warn_slow_step,
)
from slotserve.engine.core.scheduler import Scheduler
from slotserve.engine.core.slots import SlotState
from slotserve.engine.core.stats import EngineCounters, EngineStats
from slotserve.engine.decoding.speculative import build_speculator
from slotserve.engine.decoding.structured_output import GrammarMasks
from slotserve.engine.errors import EngineDeadError, InvalidRequestError
from slotserve.engine.images import ImageInput, ImageRunner, encoder_seconds
from slotserve.engine.outputs import FailureKind, FinishReason, RequestOutput, SampledToken
from slotserve.engine.prefix_cache import build_prefix_cache
from slotserve.engine.request import Request, Sequence, add_sequences, new_request
from slotserve.engine.runner_interface import AdapterInfo, Runner, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
        if runner.paged_kv is not None:  # ... and holds no cached block of an earlier engine
            runner.paged_kv.drop_holds()
        self.prefix_cache = build_prefix_cache(runner, config)
        self.speculator = build_speculator(config.speculative, info)
        self.grammars = GrammarMasks(runner.tokenizer, info)
        runner_images = runner.image_inputs if isinstance(runner, ImageRunner) else None
        self.image_inputs = runner_images if info.accepts_images else None
        self._last_step_seconds = 0.0
        self.scheduler = Scheduler(
            config,
            runner,
            info.chunk_policy,
            self.prefix_cache,
            self.speculator,
            whole_prompts=info.bidirectional,
            embed_reuses_prefix=info.pooling == "last",
            context_cost=info.context_cost,
            images=self.image_inputs,
        )
        self.counters = EngineCounters()
        self.unhealthy: str | None = None  # why the engine was poisoned
        self._live: dict[str, Request] = {}
        self._pending: Outputs = {}  # outputs of aborts, delivered by the next step

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        adapter: int = 0,
        images: SequenceOf[ImageInput] = (),
    ) -> Request:
        """Validates a request against the model's limits; raises ``InvalidRequestError``.
        Safe from any thread (reads only what is fixed at load time)."""
        validate_request(
            self.runner, self.config, prompt_token_ids, params, priority, adapter, images
        )
        request = new_request(
            self.config, request_id, prompt_token_ids, params, priority, adapter, images
        )
        return add_sequences(request, self.runner.model_info, self.runner.tokenizer)

    def add_request(self, request: Request) -> None:
        """Queues a request for admission; ``EngineDeadError`` once the engine is poisoned."""
        if self.unhealthy is not None:
            raise EngineDeadError(self.unhealthy)
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        if request.adapter and request.adapter not in adapter_ids(self.runner):
            raise InvalidRequestError(
                "the request's LoRA adapter is not loaded (any more)", param="model"
            )
        self._live[request.request_id] = request
        self.scheduler.waiting.append(request)
        self.counters.requests_submitted += 1

    def abort(self, request_id: str) -> None:
        """Ends a request (its final output comes with the next step); unknown ids are ignored
        (the request may have finished meanwhile)."""
        request = self._live.get(request_id)
        if request is not None:
            self.counters.requests_aborted += 1
            self._end_request(request, "abort", self._pending)

    @property
    def live_request_ids(self) -> list[str]:
        return list(self._live)

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """Runs one engine step and returns what each touched request produced."""
        outputs, self._pending = self._pending, {}
        if self.unhealthy is not None:
            self._fail_live(self.unhealthy, FailureKind.MODEL_UNHEALTHY, outputs)
            return stamped(outputs)
        started = time.perf_counter()
        self._expire_deadlines(outputs)
        self._release_drained()
        self._admit(outputs)
        if self.image_inputs is not None:  # between steps, within the share streams allow
            decoding = bool(self.scheduler.slots.in_state(SlotState.GENERATING))
            self.image_inputs.encode_images(
                encoder_seconds(self.config.encoder_share, decoding, self._last_step_seconds)
            )
        own_start = time.perf_counter()  # the step's own time, encodes left out: their measure
        chunks = self.scheduler.schedule()
        if not chunks:
            return stamped(outputs)
        chunks = self.grammars.attach(chunks, self.scheduler.slots.sequence_in)
        prompt_tokens = self._prompt_tokens_in(chunks)
        execute_started = time.perf_counter()
        try:
            sampled = self.runner.execute(chunks)
        except Exception as exc:
            logger.exception("runner.execute failed: the model is now unhealthy")
            self.unhealthy = f"runner failure: {type(exc).__name__}: {exc}"
            self._fail_live(self.unhealthy, FailureKind.MODEL_UNHEALTHY, outputs)
            return stamped(outputs)
        execute_seconds = time.perf_counter() - execute_started
        self.counters.execute_seconds += execute_seconds
        if prompt_tokens:
            step_tokens = sum(len(chunk.token_ids) for chunk in chunks)
            self.counters.prompt_computed_tokens += prompt_tokens
            self.counters.prompt_compute_seconds += execute_seconds * prompt_tokens / step_tokens
        for slot, scored in self.runner.take_prompt_logprobs().items():
            if (seq := self.scheduler.slots.slots[slot].sequence) is not None:
                seq.prompt_logprobs.extend(scored)
        embeddings = self.runner.take_embeddings() if any(c.embed_last for c in chunks) else {}
        self._update_from_output(chunks, sampled, embeddings, outputs)
        self._release_drained()
        self.counters.steps += 1
        self._last_step_seconds = time.perf_counter() - own_start
        elapsed = time.perf_counter() - started
        self.counters.step_seconds += elapsed
        if elapsed > self.config.slow_step_warn_s:
            warn_slow_step(self.scheduler.slots.slots, chunks, elapsed)
        return stamped(outputs)

    def _prompt_tokens_in(self, chunks: SequenceOf[ScheduledChunk]) -> int:
        """How many of the chunks' tokens are prompt positions (a resumed sequence's
        recomputed output counts as decode work)."""
        count = 0
        for chunk in chunks:
            if (seq := self.scheduler.slots.sequence_in(chunk.slot)) is not None:
                end = min(chunk.start_pos + len(chunk.token_ids), seq.num_prompt_tokens)
                count += max(0, end - chunk.start_pos)
        return count

    def fail_all(self, message: str, kind: FailureKind) -> list[RequestOutput]:
        """Ends every live request with an error (the engine is stopped or its loop broke)."""
        outputs, self._pending = self._pending, {}
        self._fail_live(message, kind, outputs)
        return stamped(outputs)

    def _fail_live(self, message: str, kind: FailureKind, outputs: Outputs) -> None:
        for request in list(self._live.values()):
            self._end_request(request, "error", outputs, error=message, failure=kind)
        self._release_drained(quietly=True)

    def _expire_deadlines(self, outputs: Outputs) -> None:
        if self.config.request_timeout_s is None:
            return
        now = time.monotonic()
        expired = [r for r in self._live.values() if r.deadline is not None and r.deadline < now]
        for request in expired:
            self.counters.requests_timed_out += 1
            self._end_request(request, "abort", outputs, failure=FailureKind.TIMED_OUT)

    def _admit(self, outputs: Outputs) -> None:
        now = time.monotonic()
        for seq in self.scheduler.admit():
            request = seq.request
            if request.admitted_time is None:
                request.admitted_time = now
                log_admitted(request, self.config.slow_queue_warn_s)
            if seq.finish_reason is not None:
                continue  # a sibling failed to start
            assert seq.slot is not None
            params = request.params
            seed = None if params.seed is None else params.seed + seq.index
            try:
                if params.structured_output is not None and seq.grammar is None:
                    seq.grammar = self.grammars.matcher(params.structured_output)
                if request.images:
                    assert self.image_inputs is not None, "validated: the model reads images"
                    self.image_inputs.add_images(seq.slot, request.images)
                self.runner.add_sequence(seq.slot, params, seq.token_ids, seed)
            except Exception as exc:
                logger.exception(
                    "request %s: runner.add_sequence failed",
                    request.request_id,
                    extra={"request_id": request.request_id},
                )
                failure = FailureKind.REQUEST_FAILED
                self._end_request(request, "error", outputs, error=str(exc), failure=failure)

    def _update_from_output(
        self,
        chunks: SequenceOf[ScheduledChunk],
        sampled: dict[int, list[SampledToken]],
        embeddings: dict[int, list[float]],
        outputs: Outputs,
    ) -> None:
        eog = self.model_info.eog_token_ids
        for chunk in chunks:
            seq = self.scheduler.on_chunk_computed(chunk)
            if chunk.embed_last:  # an embedding ends with its prompt (scheduler invariant 10)
                output_for(seq.request, outputs).embedding = embeddings[chunk.slot]
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
                self._emit(seq, outputs)
                continue
            if not chunk.sample:
                continue
            tokens = sampled[chunk.slot]
            for token in tokens:  # a verification chunk's accepted drafts, then one more
                append_token(seq, token, eog)
                self.counters.generated_tokens += 1
                if seq.finish_reason is not None:
                    break  # a stop inside an accepted run: the rest is not output
            if chunk.num_drafts:
                self.scheduler.settle_drafts(seq, chunk, len(tokens) - 1)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            self._emit(seq, outputs)

    def _emit(self, seq: Sequence, outputs: Outputs) -> None:
        request = seq.request
        out = output_for(request, outputs)
        out.deltas.append(take_delta(seq))
        out.num_output_tokens = request.num_output_tokens
        if request.finished:
            out.finished = True
            self._live.pop(request.request_id, None)
            self.counters.requests_finished += 1
            log_end(request, "finished")

    def _end_request(
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
        self._live.pop(request.request_id, None)
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

    def _release_drained(self, quietly: bool = False) -> None:
        """Releases DRAINING slots. ``quietly``: after a runner failure the runner may fail
        again; the slots are freed anyway (the engine is being given up)."""
        for slot in self.scheduler.drained_slots():
            for free in (self.runner.remove_sequence, self.scheduler.release_index):
                try:
                    free(slot.index)
                except Exception:
                    if not quietly:
                        raise
                    logger.warning("could not free slot %d after the runner failed", slot.index)

    def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        """Between steps, loads the LoRA adapter at ``path`` as ``name`` or, with no path,
        unloads ``name``; the requests using an unloaded adapter end with an error."""
        if path is not None:
            return load_adapter(self.runner, name, path)
        info = unload_adapter(self.runner, name)
        if info.adapter_id not in adapter_ids(self.runner):
            message = f"the LoRA adapter {name} was unloaded"
            for request in [r for r in self._live.values() if r.adapter == info.adapter_id]:
                self._end_request(
                    request, "error", self._pending, message, FailureKind.REQUEST_FAILED
                )
        return info

    def flush_prefix_cache(self) -> int:
        """Evicts every cached prefix no running sequence uses (``POST /flush_cache``);
        returns the tokens freed. Between steps, like any other message to the core: prefixes
        of running sequences stay (they are locked), so this is safe while requests run."""
        if self.unhealthy is not None:  # the runner's KV may not answer any more
            return 0
        return self.prefix_cache.flush()

    def close(self) -> None:
        """Saves what the prefix cache can hand to the next start (a disk tier), then closes
        the runner. A runner that failed is not read: its KV may not be what the cache says."""
        if self.unhealthy is None:
            try:
                saved = self.prefix_cache.persist()
            except Exception:
                logger.exception("could not save the prefix cache at shutdown")
            else:
                if saved:
                    logger.info("saved %d cached prefixes to disk", saved)
        self.runner.close()

    def check_integrity_when_idle(self) -> None:
        """Runs :meth:`check_integrity`, counting and logging a failure instead of raising."""
        self.counters.integrity_checks += 1
        try:
            self.check_integrity()
        except (AssertionError, RuntimeError) as exc:  # the runner's kv_tokens raises too
            self.counters.integrity_failures += 1
            self.counters.last_integrity_error = str(exc)
            logger.error("KV integrity check failed: %s", exc)

    def check_integrity(self) -> None:
        """Between steps. Raises ``AssertionError`` when slot, cache and runner KV bookkeeping
        disagree: every slot's KV must be what its sequence computed (running), or what the
        prefix cache says it holds (free or preempted)."""
        self.prefix_cache.check_integrity(self.scheduler.running_kv_tokens())

    def snapshot(self) -> EngineStats:
        """What the core publishes after a step: counters and state, built fresh."""
        scheduler = self.scheduler
        kv_slots = scheduler.running_kv_tokens()
        slots = scheduler.slots.slots
        running = {s.request.request_id for i in kv_slots if (s := slots[i].sequence)}
        preempted = len(scheduler.slots.in_state(SlotState.PREEMPTED))
        kv_used = 0
        if self.unhealthy is None and kv_slots:
            kv_used = self.runner.kv_used_tokens(list(kv_slots))
        return EngineStats(
            **vars(self.counters),
            preemptions=scheduler.num_preemptions,
            slots=scheduler.slots.snapshot(),
            num_waiting=len(scheduler.waiting) + preempted,
            num_running=len(running),
            num_free_slots=scheduler.slots.num_free,
            kv_used_tokens=kv_used,
            kv_capacity_tokens=self.model_info.kv_capacity,
            prefix_cache=replace(
                self.prefix_cache.stats(),
                computed_tokens=self.counters.prompt_computed_tokens,
                compute_seconds=self.counters.prompt_compute_seconds,
            ),
            unhealthy=self.unhealthy,
            spec_decode=self.speculator.counters.plus(None) if self.speculator else None,
        )
