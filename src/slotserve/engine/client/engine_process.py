"""The engine-core process as the API process holds it (:class:`EngineProcess`): started with
its two ZMQ sockets on IPC paths in a directory of its own, awaited until it has loaded the
model, killed when it does not stop, and cleaned up after. What travels over the sockets, and
what a death means for requests: ``mp_client.py``."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import zmq

from slotserve.engine.client import wire
from slotserve.engine.client.core_proc import POLL_MS, run_engine_core
from slotserve.engine.config import EngineConfig
from slotserve.engine.runner_interface import RunnerFrontend, RunnerSpec

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process failed to start (its load error, or how it died)."""


@dataclass
class EngineProcess:
    process: BaseProcess
    to_engine: zmq.Socket[bytes]
    from_engine: zmq.Socket[bytes]
    workdir: str  # the sockets' directory

    @classmethod
    async def start(
        cls, spec: RunnerSpec, config: EngineConfig, setup: Callable[[], None] | None
    ) -> tuple[EngineProcess, wire.Ready, RunnerFrontend]:
        """Starts the engine process (which loads the model) and the API side's tokenizer
        beside it; returns when both are ready, with what the engine said it serves, or
        raises why the engine could not start. ``setup`` runs first in the new process."""
        workdir = tempfile.mkdtemp(prefix="slotserve-engine-")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        to_engine = context.socket(zmq.PUSH)
        from_engine = context.socket(zmq.PULL)
        addresses = (f"ipc://{workdir}/in", f"ipc://{workdir}/out")
        for sock, address in zip((to_engine, from_engine), addresses, strict=True):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(spec, config, addresses, os.getpid(), setup),
            name="slotserve-engine-core",
            daemon=True,
        )
        engine = cls(process, to_engine, from_engine, workdir)
        frontend_task = asyncio.create_task(asyncio.to_thread(spec.frontend))
        try:
            process.start()
            ready = await asyncio.to_thread(_await_ready, from_engine, process)
            frontend = await frontend_task
        except BaseException:
            frontend_task.add_done_callback(_close_frontend)
            engine.kill()
            engine.close()
            raise
        logger.info("engine process %d ready", process.pid)
        return engine, ready, frontend

    def kill(self) -> None:
        process = self.process
        if process.is_alive():
            process.kill()
        if process.pid is not None:
            process.join(5.0)

    def close(self) -> None:
        """Closes the sockets and removes their directory (the process has ended)."""
        self.to_engine.close()
        self.from_engine.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _await_ready(sock: zmq.Socket[bytes], process: BaseProcess) -> wire.Ready:
    while not sock.poll(POLL_MS):
        if not process.is_alive():
            raise EngineProcessError(f"the engine process exited ({process.exitcode}) loading")
    message = wire.decode_from_engine(sock.recv())
    if isinstance(message, wire.LoadFailed):
        raise EngineProcessError(message.error)
    assert isinstance(message, wire.Ready), message
    return message


def _close_frontend(task: asyncio.Task[RunnerFrontend]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
