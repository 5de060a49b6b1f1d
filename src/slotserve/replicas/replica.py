"""One engine replica of a Ray Serve deployment: a whole ``slotserve serve`` (its engine
process, prefix cache and every endpoint) on a loopback port of the replica's node, which this
actor supervises and forwards requests to.

Why a server per replica rather than an engine object in the actor: every endpoint, validation
rule, error shape and stream behaves exactly as on one machine, and the replica's health is
the server's (``check_health``: Serve replaces a replica whose server died). The server is the
actor's child and dies with it (``slotserve.parent_death``), so a replica Ray kills leaves nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from slotserve import parent_death

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading a large model
# Hop-by-hop headers and what the proxy in front sets itself. A request keeps its Host: the
# server's access rules read the name the client used (server/access.py).
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
_DROPPED_HEADERS = _HOP_BY_HOP | {"host"}


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it. ``prompt``: the request's text (a chat's
    messages, a completion's prompt), which the prefix-aware router matches on."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str = ""


@dataclass(frozen=True)
class ResponseHead:
    """The first item of every forwarded response; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    replica_id: str = ""


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    rank: int
    actor_pid: int
    server_pid: int
    url: str


class EngineReplica:
    """The deployment's class (``launch.py`` wraps it in ``serve.deployment``)."""

    def __init__(self, serve_argv: list[str]) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.rank = context.rank.rank if context.rank is not None else 0
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = parent_death.command("slotserve.cli", "serve", *serve_argv)
        # --replicas 0: a SLOTSERVE_REPLICAS the actor inherited must not recurse.
        command += ["--host", "127.0.0.1", "--port", str(port), "--replicas", "0"]
        self.server = subprocess.Popen(command)
        self._wait_ready()
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)
        logger.info(
            "replica %s: slotserve serve pid %d at %s", self.replica_id, self.server.pid, self.url
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.server.poll()
            if code is not None:
                raise RuntimeError(f"replica {self.replica_id}: slotserve serve exited ({code})")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # polling a starting server, not synchronising with work
        self.server.kill()
        raise RuntimeError(f"replica {self.replica_id}: not ready in {READY_TIMEOUT_S:.0f} s")

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response: its head, then its body as it arrives (SSE events one by one).
        Cancelled with the caller's stream, which closes the connection to the server: a
        client that went away frees its slot there within one step."""
        headers = [(k, v) for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
        async with self.client.stream(
            request.method,
            request.path,
            params=httpx.QueryParams(request.query),
            headers=headers,
            content=request.body,
        ) as response:
            kept = [(k, v) for k, v in response.headers.multi_items() if k not in _DROPPED_HEADERS]
            yield ResponseHead(response.status_code, kept, self.replica_id)
            async for chunk in response.aiter_raw():
                yield chunk

    async def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.replica_id, self.rank, os.getpid(), self.server.pid, self.url)

    async def metrics(self) -> tuple[str, str]:
        """This replica's Prometheus text, with its id (a broadcast's answers are unordered)."""
        response = await self.client.get("/metrics", timeout=10)
        return self.replica_id, response.text

    def check_health(self) -> None:
        """Serve's health probe: the server process must live and answer ``/health``."""
        code = self.server.poll()
        if code is not None:
            raise RuntimeError(f"slotserve serve exited with code {code}")
        if httpx.get(f"{self.url}/health", timeout=10).status_code != 200:
            raise RuntimeError("slotserve serve reports itself unhealthy")

    def __del__(self) -> None:
        """Serve's graceful stop: the server drains its requests (SIGTERM), then exits."""
        server = getattr(self, "server", None)
        if server is None or server.poll() is not None:
            return
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
