"""The engine core: each step is ``schedule → runner.execute → update_from_output``. Its owner
(an engine client, ``engine/client/``) calls :meth:`EngineCore.add_request`, :meth:`~.abort`,
:meth:`~.step` and :meth:`~.snapshot` from one thread; the core has no lock, condition or
thread.

Before the batch is scheduled, a step runs its named stages: requests past their deadline end,
finished slots are released, waiting requests are admitted and their sequences started in the
runner, and queued image encodes run. The scheduler (``scheduler.py``) builds the batch, the
runner computes it, and ``update.py`` applies what came back.

A failure of ``runner.execute`` (an exception, or ``RunnerFailure`` for non-finite logits)
poisons the engine: every request still in it ends with an error of kind
``MODEL_UNHEALTHY``, :attr:`EngineCore.unhealthy` says why, and the engine does no further work.
Recovery is a new runner and a new engine (the server's reload).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from slotserve.engine.adapters import adapter_ids, load_adapter, unload_adapter
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.encoder_work import EncoderWork
from slotserve.engine.core.limits import validate_request
from slotserve.engine.core.live_requests import LiveRequests
from slotserve.engine.core.output_processor import Outputs, stamped
from slotserve.engine.core.scheduler import Scheduler
from slotserve.engine.core.sequence_start import SequenceStarter
from slotserve.engine.core.slots import SlotState
from slotserve.engine.core.stats import EngineCounters, EngineStats
from slotserve.engine.core.step_timing import StepTimer, prompt_tokens_in
from slotserve.engine.core.update import ExecutedBatch, update_from_output
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.decoding.speculative import build_speculator
from slotserve.engine.decoding.structured_output import GrammarMasks
from slotserve.engine.errors import EngineDeadError, InvalidRequestError
from slotserve.engine.images import ImageRunner
from slotserve.engine.outputs import FailureKind, RequestOutput
from slotserve.engine.prefix_cache import build_prefix_cache
from slotserve.engine.request import Request, new_request
from slotserve.engine.runner_interface import AdapterInfo, Runner, ScheduledChunk

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
        images = runner.image_inputs if isinstance(runner, ImageRunner) else None
        self.encoder: EncoderWork | None = None
        if images is not None and info.accepts_images:
            self.encoder = EncoderWork(images, config.encoder_share)
        self.scheduler = Scheduler(
            config,
            runner,
            info.chunk_policy,
            self.prefix_cache,
            self.speculator,
            whole_prompts=info.bidirectional,
            embed_reuses_prefix=info.pooling == "last",
            context_cost=info.context_cost,
            images=self.encoder,
        )
        self.counters = EngineCounters()
        self.timer = StepTimer(self.counters, config.slow_step_warn_s)
        self.unhealthy: str | None = None  # why the engine was poisoned
        self.requests = LiveRequests(self.scheduler, self.counters, config.request_timeout_s)
        self.starter = SequenceStarter(
            runner, self.grammars, self.encoder, self.requests, config.slow_queue_warn_s
        )

    # ---- requests in and out ----------------------------------------------------------------

    def validate(self, request: EngineCoreRequest) -> None:
        """Raises ``InvalidRequestError`` when the model cannot serve ``request``; any thread
        (reads only what is fixed at load time). The clients validate on the caller's side,
        so :meth:`add_request` trusts what it gets."""
        validate_request(self.runner, self.config, request)

    def add_request(self, submitted: EngineCoreRequest) -> Request:
        """Queues a validated request for admission and returns the core's state of it;
        ``EngineDeadError`` once the engine is poisoned."""
        if self.unhealthy is not None:
            raise EngineDeadError(self.unhealthy)
        if submitted.request_id in self.requests.by_id:
            raise ValueError(f"request id {submitted.request_id} is already in the engine")
        if submitted.adapter and submitted.adapter not in adapter_ids(self.runner):
            raise InvalidRequestError(
                "the request's LoRA adapter is not loaded (any more)", param="model"
            )
        request = new_request(submitted, self.config, self.model_info, self.runner.tokenizer)
        self.requests.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Ends a request (its final output comes with the next step); unknown ids are ignored
        (the request may have finished meanwhile)."""
        self.requests.abort(request_id)

    @property
    def live_request_ids(self) -> list[str]:
        return list(self.requests.by_id)

    @property
    def has_work(self) -> bool:
        return self.requests.has_pending or self.scheduler.has_work

    def fail_all(self, message: str, kind: FailureKind) -> list[RequestOutput]:
        """Ends every live request with an error (the engine is stopped or its loop broke)."""
        outputs = self.requests.take_pending()
        self._fail_live(message, kind, outputs)
        return stamped(outputs)

    def _fail_live(self, message: str, kind: FailureKind, outputs: Outputs) -> None:
        self.requests.fail_all(message, kind, outputs)
        self._release_drained(quietly=True)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step, the stages that prepare it and then schedule → execute →
        update; returns what each touched request produced."""
        outputs = self.requests.take_pending()
        if self.unhealthy is not None:
            self._fail_live(self.unhealthy, FailureKind.MODEL_UNHEALTHY, outputs)
            return stamped(outputs)
        self.timer.start()
        self._prepare(outputs)
        self.timer.own_work_starts()  # image encodes are measured apart
        chunks = self._schedule()
        batch = self._execute(chunks, outputs) if chunks else None
        if batch is not None:
            self._update_from_output(batch, outputs)
            self.timer.step_done(self.scheduler.slots.slots, chunks)
        return stamped(outputs)

    def _prepare(self, outputs: Outputs) -> None:
        """The stages before a batch is scheduled: deadlines, finished slots, admission (the
        new sequences started in the runner), and image encodes between steps."""
        self.requests.expire(outputs)
        self._release_drained()
        self.starter.start(self.scheduler.admit(), outputs)
        if self.encoder is not None:  # within the share the decoding streams allow
            decoding = bool(self.scheduler.slots.in_state(SlotState.GENERATING))
            self.encoder.run_between_steps(decoding, self.timer.last_step_seconds)

    def _schedule(self) -> list[ScheduledChunk]:
        """The scheduler's batch, with the grammar masks of constrained sequences."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return chunks
        return self.grammars.attach(chunks, self.scheduler.slots.sequence_in)

    def _execute(self, chunks: list[ScheduledChunk], outputs: Outputs) -> ExecutedBatch | None:
        """The runner's forward pass over ``chunks``, timed, and what it hands over. None when
        it failed: the engine is poisoned, and every request has its error in ``outputs``."""
        prompt_tokens = prompt_tokens_in(chunks, self.scheduler.slots)
        started = time.perf_counter()
        try:
            sampled = self.runner.execute(chunks)
        except Exception as exc:
            logger.exception("runner.execute failed: the model is now unhealthy")
            self.unhealthy = f"runner failure: {type(exc).__name__}: {exc}"
            self._fail_live(self.unhealthy, FailureKind.MODEL_UNHEALTHY, outputs)
            return None
        self.timer.executed(chunks, time.perf_counter() - started, prompt_tokens)
        prompt_logprobs = self.runner.take_prompt_logprobs()
        embeddings = self.runner.take_embeddings() if any(c.embed_last for c in chunks) else {}
        return ExecutedBatch(chunks, sampled, prompt_logprobs, embeddings)

    def _update_from_output(self, batch: ExecutedBatch, outputs: Outputs) -> None:
        eog = self.model_info.eog_token_ids
        update_from_output(batch, self.scheduler, self.requests, eog, outputs)
        self._release_drained()

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

    # ---- between steps ------------------------------------------------------------------------

    def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        """Between steps, loads the LoRA adapter at ``path`` as ``name`` or, with no path,
        unloads ``name``; the requests using an unloaded adapter end with an error."""
        if path is not None:
            return load_adapter(self.runner, name, path)
        info = unload_adapter(self.runner, name)
        if info.adapter_id not in adapter_ids(self.runner):
            message = f"the LoRA adapter {name} was unloaded"
            self.requests.fail_using_adapter(info.adapter_id, message)
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
