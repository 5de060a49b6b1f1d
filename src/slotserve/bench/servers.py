"""Servers started by a sweep: slotserve, llama.cpp's ``llama-server``, llama-cpp-python's
server and vLLM (``vllm_peer``), each on 127.0.0.1 only and always stopped (also on Ctrl-C or an
error), children included."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slotserve import parent_death

HOST = "127.0.0.1"
# How long members of a server's process group may outlive its leader before SIGKILL.
CHILD_GRACE_S = 10.0
LOG_TAIL_LINES = 30  # of a server that exits during start-up, quoted in the error


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    port: int
    # Answers 200 once the server can serve (slotserve listens while its model loads).
    ready_path: str = "/v1/models"
    # Set on top of this process's environment (vLLM reads its CPU settings from there).
    env: dict[str, str] = field(default_factory=dict)
    # vLLM compiles and profiles for minutes on a small CPU before it answers.
    start_timeout_s: float = 300.0

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class RunningServer:
    spec: ServerSpec
    pid: int

    @property
    def api_url(self) -> str:
        return self.spec.base_url + "/v1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def slotserve_spec(
    model: Path, slots: int, threads: int, ctx_per_slot: int, extra_args: Sequence[str] = ()
) -> ServerSpec:
    port = free_port()
    return ServerSpec(
        "slotserve",
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "serve",
            str(model),
            "--host",
            HOST,
            "--port",
            str(port),
            "--slots",
            str(slots),
            "--threads",
            str(threads),
            # A command line that sizes a sequence itself (--max-model-len) keeps that alone:
            # a runner refuses both spellings at once.
            *(() if "--max-model-len" in extra_args else ("--ctx-size", str(ctx_per_slot * slots))),
            "--max-queue",
            "1024",
            "--log-level",
            "warning",
            *extra_args,
        ],
        port,
        ready_path="/ready",
    )


def amx_host() -> bool:
    """Whether this CPU has AMX-INT8 tiles (Linux's flags in /proc/cpuinfo)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def repack_args(binary: Path) -> list[str]:
    """``--no-repack`` for a llama-server built outside ``build_llama_server.sh`` on an AMX
    host: a native build there may carry ggml's AMX matmul, which crashes at warm-up
    (runners/llama_cpp/cpu.py); the script's own build leaves it out and keeps repacking."""
    ours = DEFAULT_LLAMA_SERVER.resolve() in binary.resolve().parents
    return ["--no-repack"] if amx_host() and not ours else []


def llama_server_spec(
    binary: Path, model: Path, slots: int, threads: int, ctx_per_slot: int
) -> ServerSpec:
    port = free_port()
    return ServerSpec(
        "llama-server",
        [
            str(binary),
            "-m",
            str(model),
            "--host",
            HOST,
            "--port",
            str(port),
            "-np",
            str(slots),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx_per_slot * slots),
            "--log-disable",
            *repack_args(binary),
        ],
        port,
    )


def llama_cpp_python_spec(model: Path, threads: int, ctx: int) -> ServerSpec:
    """llama-cpp-python's own server: one sequence at a time, whatever the concurrency."""
    port = free_port()
    return ServerSpec(
        "llama-cpp-python",
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            HOST,
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_ctx",
            str(ctx),
            # By default a new request interrupts the one streaming; queue them instead.
            "--interrupt_requests",
            "False",
        ],
        port,
    )


@contextlib.contextmanager
def running(
    spec: ServerSpec, log_dir: Path, timeout_s: float | None = None
) -> Iterator[RunningServer]:
    """Starts the server, waits until it is ready (``timeout_s``, else the spec's own start-up
    limit), and always stops it."""
    timeout_s = spec.start_timeout_s if timeout_s is None else timeout_s
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}-{spec.port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            parent_death.exec_command(spec.command),  # a killed bench leaves no server behind
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it reaches its children
            env={**os.environ, **spec.env} if spec.env else None,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                # The log's end says why; its folder is often a temporary one, gone soon.
                tail = "\n".join(
                    log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                )
                raise RuntimeError(
                    f"{spec.name} exited with {process.returncode}; {log_path} ends:\n{tail}"
                )
            try:
                if httpx.get(spec.base_url + spec.ready_path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name} did not answer within {timeout_s:.0f} s")
            time.sleep(0.25)  # start-up poll
        yield RunningServer(spec, process.pid)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s; then the same for members of
    the group that outlive the leader (vLLM's engine-core process, multiprocessing workers)."""
    group = process.pid  # start_new_session: the group id is the leader's pid
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            process.wait()
    if _wait_group(group, CHILD_GRACE_S):  # children finishing their own shutdown
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    _wait_group(group, 5.0)  # SIGKILL takes effect asynchronously


def _wait_group(group: int, seconds: float) -> bool:
    """Whether the group emptied within ``seconds``."""
    deadline = time.monotonic() + seconds
    while _group_alive(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in the group; zombies count as stopped,
    since whoever adopted them reaps them, not us."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: the kernel's answer, zombies included
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def add_peer_program_argument(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """``flag``: where a peer's program is, by default from its ``SLOTSERVE_*`` variable
    (``--vllm-python``: ``SLOTSERVE_VLLM_PYTHON``)."""
    variable = "SLOTSERVE_" + flag.removeprefix("--").replace("-", "_").upper()
    parser.add_argument(flag, type=Path, default=os.environ.get(variable), help=help)


DEFAULT_LLAMA_SERVER = Path(__file__).resolve().parents[3] / ".peers"


def find_llama_server(explicit: Path | None) -> Path | None:
    """The llama-server binary: ``explicit``, else the one build_llama_server.sh built, else
    one on PATH; None when there is none."""
    if explicit is not None:
        return explicit if explicit.is_file() else None
    built = sorted(DEFAULT_LLAMA_SERVER.glob("build-*/bin/llama-server"))
    if built:
        return built[-1]
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None
