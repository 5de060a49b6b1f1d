"""The boundary between the serving side and the engine core.

:class:`~slotserve.engine.client.async_engine.AsyncEngine` is what request handlers use; it
talks to the core through an :class:`~slotserve.engine.client.base.EngineCoreClient`, chosen
by :func:`make_client`: :class:`~slotserve.engine.client.inproc_client.InprocClient` runs the
core on a thread of this process, :class:`~slotserve.engine.client.mp_client.MPClient` in a
process of its own (``core_proc`` is that process's loop, ``engine_process`` its start and end,
``wire`` their messages: a request travels as the engine's own ``EngineCoreRequest``).
"""

from __future__ import annotations

from collections.abc import Callable

from slotserve.engine.client.base import Deliver, EngineCoreClient
from slotserve.engine.client.inproc_client import InprocClient
from slotserve.engine.client.mp_client import MPClient
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.runner_interface import Runner, RunnerSpec


async def make_client(
    build_runner: Callable[[], Runner],
    config: EngineConfig,
    deliver: Deliver,
    *,
    engine_process: bool,
    process_setup: Callable[[], None] | None = None,
) -> EngineCoreClient:
    """Starts an engine core over the runner ``build_runner`` makes and returns its client:
    in a process of its own (``build_runner`` must then be a picklable ``RunnerSpec``;
    ``process_setup`` runs first there) or on a thread of this one. Returns once the model
    is loaded; raises why it could not be."""
    if engine_process:
        if not isinstance(build_runner, RunnerSpec):
            raise TypeError("an engine process needs a RunnerSpec to build its runner")
        return await MPClient.launch(build_runner, config, deliver, process_setup)

    def build_core() -> EngineCore:
        runner = build_runner()
        try:
            return EngineCore(runner, config)
        except BaseException:
            runner.close()
            raise

    return await InprocClient.launch(build_core, deliver)
