"""A real server on loopback inside the test process: the app the CLI builds, served by uvicorn
in a thread, so a test can hand it a runner of its own (a fault-injecting wrapper)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import uvicorn

from slotserve.engine.config import EngineConfig
from slotserve.engine.runner_interface import Runner
from slotserve.hosting.host import ModelHost
from slotserve.hosting.registry import ModelRegistry
from slotserve.hosting.served import ModelLaunch, RestartPolicy
from slotserve.server.app import create_app
from slotserve.server.metrics import ServerMetrics
from slotserve.server.serving import ServingContext
from tests.conftest import _free_port, wait_until


@dataclass
class LiveServer:
    base_url: str
    host: ModelHost

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"


@contextlib.contextmanager
def live_server(
    build_runner: Callable[[], Runner],
    config: EngineConfig,
    name: str = "live",
    restart: RestartPolicy | None = None,
) -> Iterator[LiveServer]:
    metrics = ServerMetrics()
    models = ModelRegistry(on_outputs=metrics.observe)
    host = models.add(ModelLaunch(name, build_runner, config, restart=restart or RestartPolicy()))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(ServingContext(models, metrics)),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
        )
    )
    thread = threading.Thread(target=server.run, name="live-uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base_url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        if not wait_until(ready, timeout=120, interval=0.1):
            raise RuntimeError("the live server did not become ready")
        yield LiveServer(base_url, host)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
