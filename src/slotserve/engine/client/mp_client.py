"""The hand-off between the serving side and the engine core as a second process (vLLM v1's
split): :class:`MPClient` in the API process; ``core_proc.py`` is the other end.

The API process keeps HTTP, chat templates, tokenization and request validation (with its own
copy of the tokenizer, :class:`~slotserve.engine.runner_interface.RunnerFrontend`); the engine
process keeps the scheduler, the runner and the detokenizer (stop strings end a sequence in
the step that produced them, so its slot is freed there and usage counts stay exact) and steps
in a busy loop while it has work. Messages are ``wire.py``'s msgspec structs over two ZMQ
PUSH/PULL sockets on IPC paths; a thread in the API process receives outputs and hands them to
the event loop, as the in-thread client does.

Failure handling: the receiving thread watches the process (its sentinel wakes the thread); if
it dies (killed, segfault, out of memory), every request still in it ends at once with a
``MODEL_UNHEALTHY`` error and
:attr:`MPClient.unhealthy` says why, so health and readiness turn 503 and a reload starts a
new process. The engine process asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``) and also polls its parent while idle, so no orphan outlives the server.
It ignores SIGINT and SIGTERM: the API process drains and then stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable
from typing import Any

import zmq

from slotserve.engine.adapters import AdapterNotFoundError
from slotserve.engine.client import wire
from slotserve.engine.client.base import ClientState, Deliver, Settle, answer
from slotserve.engine.client.core_proc import POLL_MS
from slotserve.engine.client.engine_process import EngineProcess
from slotserve.engine.config import EngineConfig
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError, InvalidRequestError
from slotserve.engine.outputs import STOPPED_REASON, FailureKind, RequestOutput
from slotserve.engine.runner_interface import AdapterInfo, RunnerFrontend, RunnerSpec

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a stopping engine closes its runner; then it is killed


class MPClient(ClientState):
    """The API process's end: the same methods as ``InprocClient``."""

    def __init__(
        self,
        engine: EngineProcess,
        ready: wire.Ready,
        frontend: RunnerFrontend,
        config: EngineConfig,
        deliver: Deliver,
    ) -> None:
        super().__init__(config, ready.model_info, frontend.tokenizer, ready.stats, deliver)
        self._frontend = frontend
        self._engine = engine
        self._process = engine.process
        self._to_engine, self._from_engine = engine.to_engine, engine.from_engine
        self._forward_seconds = 0.0
        self._sent = 0  # requests sent; the engine says how many it has taken
        self._received = 0
        self._live: set[str] = set()
        self._awaiting: dict[int, Settle] = {}  # flushes and adapter calls, by id
        self._call_ids = 0
        self._receiver = threading.Thread(target=self._receive, name="slotserve-engine-out")
        self._receiver.daemon = True
        self._receiver.start()

    @classmethod
    async def launch(
        cls,
        spec: RunnerSpec,
        config: EngineConfig,
        deliver: Deliver,
        setup: Callable[[], None] | None = None,
    ) -> MPClient:
        """Starts the engine process (which loads the model) and the API side's tokenizer
        beside it; returns when both are ready, or raises why the engine could not start
        (``EngineProcessError``). ``setup`` runs first in the new process (logging)."""
        engine, ready, frontend = await EngineProcess.start(spec, config, setup)
        return cls(engine, ready, frontend, config, deliver)

    # ---- the serving side (event loop) -----------------------------------------------------

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validates here and sends the request whole; the engine process builds its
        sequences (and detokenizers)."""
        self._validate(request)
        try:
            with self._lock:
                self._refuse_unless_serving()
                self._refuse_when_full(self._sent - self._received)
                self._send_or_refuse(request)
                self._sent += 1
                self._live.add(request.request_id)
        except EngineDeadError as refused:
            raise self._notice_death(refused) from None

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live and self._dead is None:
                self._send_quietly(wire.Abort([request_id]))

    async def flush_prefix_cache(self) -> int:
        freed: int = await self._call(wire.FlushPrefixCache)
        return freed

    async def call_adapter(self, name: str, path: str | None) -> AdapterInfo:
        info: AdapterInfo = await self._call(lambda call_id: wire.AdapterCall(call_id, name, path))
        return info

    async def _call(self, message: Callable[[int], wire.ToEngine]) -> Any:
        """Sends the ``message`` made with a fresh call id and awaits the engine's answer,
        which the receiving thread settles by that id."""
        done, settle = answer()
        try:
            with self._lock:
                self._refuse_unless_serving()
                self._call_ids += 1
                self._send_or_refuse(message(self._call_ids))
                self._awaiting[self._call_ids] = settle
        except EngineDeadError as refused:
            raise self._notice_death(refused) from None
        return await done

    def stop(self, reason: str = STOPPED_REASON) -> None:
        """Asks the engine process to end its requests (saying ``reason``) and exit."""
        with self._lock:
            if not self._stopping and self._dead is None:
                self._send_quietly(wire.Stop(reason))
            self._stopping = True

    def _send_or_refuse(self, message: wire.ToEngine) -> None:
        """Under the lock; never blocks the event loop: a dead peer's socket refuses at once,
        and so does this (``EngineDeadError``)."""
        try:
            self._to_engine.send(wire.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine process is not taking requests") from None

    def _notice_death(self, refused: EngineDeadError) -> EngineDeadError:
        """Not under the lock, after new work was ``refused``; returns the error to raise. The
        receiving thread may not have woken yet: if the process has exited, this ends it now
        (and its requests), so that :attr:`unhealthy` says so at once and the
        requests after this one are refused as a dead engine's (the host says it restarts),
        not offered one by one to a peer that is gone."""
        if self._dead is None and multiprocessing.connection.wait([self._process.sentinel], 0):
            self._on_death(None)
        return EngineDeadError(self._dead) if self._dead is not None else refused

    def _send_quietly(self, message: wire.ToEngine) -> None:
        """Under the lock. A peer that cannot take it is dead or dying: the receiving thread
        sees that and ends every request."""
        with contextlib.suppress(zmq.Again):
            self._to_engine.send(wire.encode(message), zmq.NOBLOCK, copy=False)

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stops the engine process (killing it if it does not exit in time); requests still
        in it end with an error output, so no caller waits forever."""
        self.stop(reason)
        await asyncio.to_thread(self._receiver.join, STOP_TIMEOUT_S)
        await asyncio.to_thread(self._process.join, 5.0)
        self._engine.kill()
        await asyncio.to_thread(self._receiver.join)
        self._fail_live(reason, FailureKind.ENGINE_STOPPED)
        self._engine.close()
        self._frontend.close()

    # ---- the receiving thread --------------------------------------------------------------

    def _receive(self) -> None:
        try:
            self._receive_until_stopped()
        except Exception as exc:  # a broken message or socket: nothing more will arrive
            logger.exception("receiving from the engine process failed")
            self._on_death(f"the engine process connection broke: {type(exc).__name__}: {exc}")

    def _receive_until_stopped(self) -> None:
        sock = self._from_engine
        # The process's sentinel wakes the thread the moment the process ends (its last
        # outputs, still in the socket, are read first); the timeout is only a safety net.
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        while True:
            if sock not in dict(poller.poll(POLL_MS)):
                if not self._process.is_alive():
                    self._on_death(None)
                    return
                continue
            message = wire.decode_from_engine(sock.recv(copy=False).bytes)
            if isinstance(message, wire.Stopped):
                return
            if isinstance(message, wire.PrefixCacheFlushed):
                with self._lock:
                    waiting = [self._awaiting.pop(i, None) for i in message.flush_ids]
                for settle in waiting:
                    if settle is not None:
                        settle(message.freed_tokens)
                continue
            if isinstance(message, wire.AdapterAnswer):
                self._answer_adapter_call(message)
                continue
            if isinstance(message, wire.Crashed):
                self._on_death(message.error)
                return
            if not isinstance(message, wire.StepOutputs):
                continue
            with self._lock:
                self._published, self._received = message.stats, message.received
                self._forward_seconds = message.forward_seconds
                for out in message.outputs:
                    if out.finished:
                        self._live.discard(out.request_id)
            if message.outputs:
                self._deliver(message.outputs)

    def _answer_adapter_call(self, message: wire.AdapterAnswer) -> None:
        with self._lock:
            settle = self._awaiting.pop(message.call_id, None)
        if settle is None:
            return
        if message.info is not None:
            settle(message.info)
        elif message.not_found:
            settle(AdapterNotFoundError(message.error))
        else:
            settle(InvalidRequestError(message.error or "", param=message.param or "lora_name"))

    def _on_death(self, error: str | None) -> None:
        """The process died or its loop crashed: refuse new work, end every request."""
        if error is None:
            if self._stopping:
                return
            code = self._process.exitcode  # None: the other thread is reaping it right now
            how = "exited" if code is None else f"exit {code}"
            how = f"killed by signal {-code}" if code is not None and code < 0 else how
            error = f"the engine process died ({how})"
        message = error
        with self._lock:
            if self._dead is not None:
                return  # noticed already (by a refused send), its requests ended
            self._dead = message
        logger.error("%s: failing its requests", message)
        self._fail_live(message, FailureKind.MODEL_UNHEALTHY)

    def _fail_live(self, message: str, kind: FailureKind) -> None:
        with self._lock:
            live, self._live = self._live, set()
            flushes, self._awaiting = list(self._awaiting.values()), {}
        for settle in flushes:  # no step will answer them any more
            settle(EngineDeadError(message))
        if live:
            outputs = [RequestOutput(i, finished=True, error=message, failure=kind) for i in live]
            with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
                self._deliver(outputs)
