"""The engine core on a thread of this process (embedding, tests, ``--no-engine-process``).

:class:`InprocClient` owns the engine thread, which builds the core (loads the model), then
loops: take the inbox (new requests, aborts) → ``core.step()`` → hand the outputs over →
publish ``core.snapshot()``. Callers on other threads only touch the locked inbox and the last
published snapshot; the core itself never sees a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from slotserve.engine.adapters import AdapterNotFoundError
from slotserve.engine.client.base import ClientState, Deliver, Settle, answer
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError, InvalidRequestError
from slotserve.engine.outputs import STOPPED_REASON, FailureKind, RequestOutput
from slotserve.engine.runner_interface import AdapterInfo

logger = logging.getLogger(__name__)


class InprocClient(ClientState):
    def __init__(self, core: EngineCore, deliver: Deliver) -> None:
        super().__init__(
            core.config, core.model_info, core.runner.tokenizer, core.snapshot(), deliver
        )
        self.core = core
        self._work_ready = threading.Condition(self._lock)
        self._inbox: list[EngineCoreRequest] = []
        self._aborts: list[str] = []
        self._flushes: list[Settle] = []  # flush_prefix_cache calls waiting for the thread
        self._flushed: list[tuple[Settle, int]] = []  # done; answered once published
        self._adapter_calls: list[tuple[str, str | None, Settle]] = []  # call_adapter's
        self._in_transit = 0  # requests taken from the inbox, not yet in a published snapshot
        self._thread: threading.Thread | None = None

    @classmethod
    async def launch(cls, build: Callable[[], EngineCore], deliver: Deliver) -> InprocClient:
        """Starts an engine thread that first builds its core (loads the model) and then runs
        it; returns once the core is built, or raises what ``build`` raised.

        NOTE: the runner is loaded on the thread that will run it. PyTorch's OpenMP keeps a
        worker team per calling thread, and libgomp shortens its workers' spin-wait when
        more threads are managed than there are cores: a model loaded on another thread
        left a second team behind and made every forward pass markedly slower.
        """
        loop = asyncio.get_running_loop()
        built: asyncio.Future[InprocClient] = loop.create_future()

        def settle(result: InprocClient | BaseException) -> None:
            if built.done():  # the caller gave up waiting (shutdown during the load)
                if isinstance(result, InprocClient):
                    result.stop()
                return
            if isinstance(result, BaseException):
                built.set_exception(result)
            else:
                built.set_result(result)

        def run() -> None:
            try:
                client = cls(build(), deliver)
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle, exc)
                return
            client._thread = threading.current_thread()
            loop.call_soon_threadsafe(settle, client)
            client._run()

        threading.Thread(target=run, name="slotserve-engine", daemon=True).start()
        return await built

    # ---- any thread -------------------------------------------------------------------------

    @property
    def forward_seconds(self) -> float:
        return float(self.core.runner.forward_seconds)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validates a request here and queues it for the engine thread; raises
        ``InvalidRequestError``, then ``QueueFullError`` when the queue is full and
        ``EngineDeadError`` when the engine no longer serves, all at once."""
        self._validate(request)
        with self._lock:
            self._refuse_unless_serving()
            self._refuse_when_full(len(self._inbox) + self._in_transit)
            self._inbox.append(request)
            self._work_ready.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._work_ready.notify()

    async def flush_prefix_cache(self) -> int:
        done, settle = answer()
        with self._lock:
            self._refuse_unless_serving()
            self._flushes.append(settle)
            self._work_ready.notify()
        freed: int = await done
        return freed

    async def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        done, settle = answer()
        with self._lock:
            self._refuse_unless_serving()
            self._adapter_calls.append((name, path, settle))
            self._work_ready.notify()
        info: AdapterInfo = await done
        return info

    def stop(self) -> None:
        """Asks the engine thread to end after its current step."""
        with self._lock:
            self._stopping = True
            self._work_ready.notify_all()

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stops the engine thread and closes the runner. Requests still in the engine end
        with an error output (their streams close), so no caller waits forever."""
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # The engine thread is gone, so this thread may drive the core.
        with self._lock:
            pending, self._inbox = self._inbox, []
        for request in pending:
            self.core.add_request(request)
        self._deliver(self.core.fail_all(reason, FailureKind.ENGINE_STOPPED))
        self._refuse_flushes(reason)
        self.core.close()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while self.take_inbox():
                outputs = core.step()
                snapshot = core.snapshot()
                with self._lock:
                    self._published, self._in_transit = snapshot, 0
                    flushed, self._flushed = self._flushed, []
                for settle, freed in flushed:  # the snapshot shows the flush now
                    settle(freed)
                if outputs:
                    self._deliver(outputs)
                if core.unhealthy is not None:
                    return  # poisoned: every request has its error; nothing more to run
                if not core.has_work:
                    core.check_integrity_when_idle()
                    snapshot = core.snapshot()
                    with self._lock:
                        self._published = snapshot
        except Exception as exc:
            logger.exception("engine loop crashed")
            self._fail_everything(f"engine loop crashed: {type(exc).__name__}: {exc}")
        finally:
            # Poisoned, crashed or stopping: no step will answer a flush any more.
            self._refuse_flushes(self.unhealthy or "the engine is stopping")

    def _refuse_flushes(self, reason: str) -> None:
        with self._lock:
            waiting = self._flushes + [settle for settle, _ in self._flushed]
            waiting += [settle for _, _, settle in self._adapter_calls]
            self._flushes, self._flushed, self._adapter_calls = [], [], []
        for settle in waiting:
            settle(EngineDeadError(reason))

    def _fail_everything(self, message: str) -> None:
        """After a crash of the loop: refuse new work and end every request known to the
        core or still in the inbox with an error, even if the core is too broken to say so."""
        with self._lock:
            self._dead = message
            pending, self._inbox = self._inbox, []
        kind = FailureKind.MODEL_UNHEALTHY
        try:
            for request in pending:
                self.core.add_request(request)
            outputs = self.core.fail_all(message, kind)
        except Exception:
            logger.exception("the engine core could not end its requests")
            ids = {*self.core.live_request_ids, *(r.request_id for r in pending)}
            outputs = [RequestOutput(i, finished=True, error=message, failure=kind) for i in ids]
        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
            self._deliver(outputs)

    def take_inbox(self) -> bool:
        """Waits for work, then hands new requests and aborts to the core; False when
        stopping."""
        with self._lock:
            while not (
                self._inbox
                or self._aborts
                or self._flushes
                or self._adapter_calls
                or self.core.has_work
                or self._stopping
            ):
                self._work_ready.wait()
            if self._stopping:
                return False
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            flushes, self._flushes = self._flushes, []
            calls, self._adapter_calls = self._adapter_calls, []
            self._in_transit = len(new)
        refused = []
        for request in new:
            try:
                self.core.add_request(request)
            except Exception as exc:  # one bad request must not end the loop
                logger.exception("request %s refused by the engine core", request.request_id)
                failure = FailureKind.REQUEST_FAILED
                refused.append(
                    RequestOutput(
                        request.request_id, finished=True, error=str(exc), failure=failure
                    )
                )
        for request_id in aborts:
            self.core.abort(request_id)
        for name, path, settle in calls:
            try:
                settle(self.core.call_adapter(name, path))
            except (InvalidRequestError, AdapterNotFoundError) as exc:
                settle(exc)
            except Exception as exc:  # a failed load must not end the loop
                logger.exception("the adapter call for %s failed", name)
                settle(InvalidRequestError(f"{type(exc).__name__}: {exc}", param="lora_path"))
        if flushes:  # one flush answers every caller waiting for one
            freed = self.core.flush_prefix_cache()
            with self._lock:
                self._flushed += [(settle, freed) for settle in flushes]
        if refused:
            self._deliver(refused)
        return True
