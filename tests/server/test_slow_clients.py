"""Slow and idle clients neither block others nor exhaust the server. While twenty bodies
trickle in a byte a second, /health and a small chat request answer at once (and the slow
requests are served once complete). Under a shell's usual open-file limit (1,024), a thousand
idle keep-alive connections plus a thousand that never send a byte leave /health and chat
answering and memory flat; the server then closes them all (server/connections.py). A client
that waits as long as a Retry-After told it finds its kept-alive connection still open."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slotserve.hosting.served import LOADING_RETRY_AFTER_S
from slotserve.server.connections import KEEP_ALIVE_S
from tests.conftest import ServerProcess, start_server, stop_server, wait_until

SHELL_FILE_LIMIT = 1024  # the soft limit a login shell usually gives
IDLE = 1000  # connections of each kind
SLOW = 20  # bodies trickling in at once
TRICKLE_S = 5  # bytes each sends, one a second, before the rest
HEALTH_BOUND_S = 1.0
CHAT_BOUND_S = 2.0  # plus 4 × the idle median: a generation shares 2 cores with the clients
RSS_GROWTH_BOUND_MB = 64  # ~3 MB per thousand connections measured; a leak would be far more


@contextlib.contextmanager
def open_file_limit(soft: int) -> Iterator[None]:
    """This process's soft limit lowered to ``soft``: a server spawned meanwhile inherits it."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, old[0]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with open_file_limit(SHELL_FILE_LIMIT):
        proc = start_server(tmp_path_factory.mktemp("slow"), "--slots", "2")
    yield proc
    stop_server(proc)


def chat_body(content: str = "Hi") -> bytes:
    return json.dumps(
        {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    ).encode()


def probes(probe: httpx.Client) -> tuple[float, float]:
    """One /health and one small chat request: their latencies."""
    latencies = []
    for request in (
        probe.build_request("GET", "/health"),
        probe.build_request(
            "POST",
            "/v1/chat/completions",
            content=chat_body(),
            headers={"content-type": "application/json"},
        ),
    ):
        started = time.monotonic()
        response = probe.send(request)
        assert response.status_code == 200, response.text
        latencies.append(time.monotonic() - started)
    return latencies[0], latencies[1]


def connect(server: ServerProcess) -> socket.socket:
    port = httpx.URL(server.base_url).port
    assert port is not None
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def server_fds(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


def server_rss_mb(server: ServerProcess) -> float:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) / 1024


def read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length (what these routes send)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the headers: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False  # still open, nothing to read
    except ConnectionResetError:
        return True


def test_bodies_sent_a_byte_a_second_block_no_one(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as probe:
        probe.get("/health")  # connect before timing
        idle = [probes(probe) for _ in range(3)]
        idle_chat = statistics.median(chat for _, chat in idle)
        body = chat_body("Tell me about slow clients.")
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        slow = [connect(server) for _ in range(SLOW)]
        for sock in slow:
            sock.sendall(head)
        latencies = []
        for sent in range(TRICKLE_S):
            tick = time.monotonic()
            for sock in slow:
                sock.sendall(body[sent : sent + 1])
            latencies.append(probes(probe))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))  # the pace: a byte a second
        healths = [h for h, _ in latencies]
        chats = [c for _, c in latencies]
        print(f"/health worst {max(healths):.3f} s, chat worst {max(chats):.3f} s")
        assert max(healths) < HEALTH_BOUND_S, healths
        assert max(chats) < 4 * idle_chat + CHAT_BOUND_S, (chats, idle_chat)
        # Still waiting, not dropped; served once the rest arrives.
        assert not any(closed_by_server(sock) for sock in slow)
        for sock in slow:
            sock.settimeout(60)
            sock.sendall(body[TRICKLE_S:])
        for sock in slow:
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "a slow request failed"
            sock.close()


def test_a_thousand_idle_connections_and_a_thousand_silent_ones(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as probe:
        probe.get("/health")
        assert wait_until(lambda: server_fds(server) < 100), server_fds(server)
        fds_before, rss_before = server_fds(server), server_rss_mb(server)
        idle = [connect(server) for _ in range(IDLE)]
        for sock in idle:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for sock in idle:
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        silent = [connect(server) for _ in range(IDLE)]
        held = server_fds(server)
        health, chat = probes(probe)
        rss_growth = server_rss_mb(server) - rss_before
        print(
            f"{held - fds_before} connections held: /health {health:.3f} s, chat {chat:.3f} s, "
            f"RSS +{rss_growth:.1f} MB"
        )
        # More connections than the shell's limit would allow, and still answering.
        assert held - fds_before > SHELL_FILE_LIMIT, (fds_before, held)
        assert health < HEALTH_BOUND_S and chat < CHAT_BOUND_S + 1.0, (health, chat)
        assert rss_growth < RSS_GROWTH_BOUND_MB, rss_growth

        # Idle past the keep-alive timeout, the silent ones too: the server closes them all.
        everyone = idle + silent
        assert wait_until(
            lambda: all(closed_by_server(sock) for sock in everyone), timeout=KEEP_ALIVE_S + 30
        ), sum(not closed_by_server(sock) for sock in everyone)
        for sock in everyone:
            sock.close()
        assert wait_until(lambda: server_fds(server) <= fds_before + 2), server_fds(server)
        assert probe.get("/health").status_code == 200


def test_a_client_that_waits_as_told_finds_its_connection_open(server: ServerProcess) -> None:
    # At uvicorn's default keep-alive (5 s, the Retry-After of a loading model) the server
    # closed the connection just as such a client sent its next request on it.
    sock = connect(server)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    sock.sendall(request)
    assert read_response(sock).startswith(b"HTTP/1.1 200")
    time.sleep(LOADING_RETRY_AFTER_S + 0.5)  # the client waiting as a Retry-After told it
    assert not closed_by_server(sock)
    sock.settimeout(30)
    sock.sendall(request)
    assert read_response(sock).startswith(b"HTTP/1.1 200")
    sock.close()
