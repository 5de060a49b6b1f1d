"""The engine-core process (``--engine-process``): builds the runner and the core from a
picklable ``RunnerSpec``, then serves ``mp_client.MPClient`` over two ZMQ sockets until
told to stop. See ``mp_client.py`` for the protocol and the failure handling."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

import zmq

from slotserve import parent_death
from slotserve.engine.adapters import AdapterNotFoundError
from slotserve.engine.client import wire
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import FailureKind, RequestOutput
from slotserve.engine.runner_interface import RunnerSpec

logger = logging.getLogger(__name__)

POLL_MS = 500  # how often an idle side checks that the other one is still there


def run_engine_core(
    spec: RunnerSpec,
    config: EngineConfig,
    addresses: tuple[str, str],
    parent_pid: int,
    setup: Callable[[], None] | None,
) -> None:
    """Builds the runner and the core, then serves: take messages, step while there is work,
    send each step's outputs and the published state."""
    _die_with_parent(parent_pid)
    if setup is not None:
        setup()
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(addresses[0])
    outbox.connect(addresses[1])
    try:
        core = EngineCore(spec(), config)
    except BaseException as exc:
        logger.exception("the engine process could not load the model")
        outbox.send(wire.encode(wire.LoadFailed(f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=5000)
        return
    outbox.send(wire.encode(wire.Ready(core.model_info, core.snapshot())))
    last_word: wire.FromEngine = wire.Stopped()
    try:
        _serve(core, inbox, outbox, parent_pid)
    except Exception as exc:
        logger.exception("engine loop crashed")
        last_word = wire.Crashed(f"engine loop crashed: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            core.close()
        outbox.send(wire.encode(last_word))
        outbox.close(linger=5000)
        inbox.close(linger=0)


def _serve(
    core: EngineCore, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes], parent_pid: int
) -> None:
    received = 0
    while True:
        if not core.has_work and not inbox.poll(POLL_MS):
            if os.getppid() != parent_pid:
                return  # the parent is gone (its death signal covers the rest)
            continue
        refused: list[RequestOutput] = []
        flush_ids: list[int] = []
        answers: list[wire.AdapterAnswer] = []
        while True:  # everything that arrived, before the step
            try:
                frame = inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = wire.decode_to_engine(frame.bytes)
            if isinstance(message, wire.Stop):
                outputs = core.fail_all(message.reason, FailureKind.ENGINE_STOPPED)
                _publish(core, outbox, outputs, received)
                return
            if isinstance(message, wire.Abort):
                for request_id in message.request_ids:
                    core.abort(request_id)
                continue
            if isinstance(message, wire.FlushPrefixCache):
                flush_ids.append(message.flush_id)
                continue
            if isinstance(message, wire.AdapterCall):
                answers.append(_call_adapter(core, message))
                continue
            received += 1
            refusal = _add(core, message)
            if refusal is not None:
                refused.append(refusal)
        freed = core.flush_prefix_cache() if flush_ids else 0
        outputs = refused + core.step()
        _publish(core, outbox, outputs, received)
        if flush_ids:  # after the snapshot that shows it
            outbox.send(wire.encode(wire.PrefixCacheFlushed(flush_ids, freed)))
        for answer in answers:
            outbox.send(wire.encode(answer))
        if not core.has_work and core.unhealthy is None:
            core.check_integrity_when_idle()
            _publish(core, outbox, [], received)


def _add(core: EngineCore, request: EngineCoreRequest) -> RequestOutput | None:
    """Adds a request the API process validated; one the core refuses gets an error output
    instead of ending the loop."""
    try:
        core.add_request(request)
        return None
    except Exception as exc:
        logger.exception("request %s refused by the engine core", request.request_id)
        kind = FailureKind.MODEL_UNHEALTHY if core.unhealthy else FailureKind.REQUEST_FAILED
        return RequestOutput(request.request_id, finished=True, error=str(exc), failure=kind)


def _call_adapter(core: EngineCore, call: wire.AdapterCall) -> wire.AdapterAnswer:
    try:
        return wire.AdapterAnswer(call.call_id, core.call_adapter(call.name, call.path))
    except AdapterNotFoundError as exc:
        return wire.AdapterAnswer(call.call_id, None, str(exc), not_found=True)
    except InvalidRequestError as exc:
        return wire.AdapterAnswer(call.call_id, None, exc.message, param=exc.param)
    except Exception as exc:  # a failed load must not end the loop
        logger.exception("the adapter call for %s failed", call.name)
        return wire.AdapterAnswer(call.call_id, None, f"{type(exc).__name__}: {exc}")


def _publish(
    core: EngineCore, outbox: zmq.Socket[bytes], outputs: list[RequestOutput], received: int
) -> None:
    forward = float(core.runner.forward_seconds)
    message = wire.StepOutputs(outputs, core.snapshot(), received, forward)
    outbox.send(wire.encode(message), copy=False)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies, and no SIGINT/SIGTERM of our own: a Ctrl-C in the
    terminal reaches the whole process group, and the parent drains before stopping us."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_death.die_with(parent_pid, signal.SIGKILL)
