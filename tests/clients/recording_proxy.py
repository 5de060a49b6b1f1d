"""A loopback HTTP proxy that keeps every request body a client sends and passes the request
on to a server, streaming the answer back: how the client tests see what an agent CLI really
sends, rather than what its documentation says it sends."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class RecordingProxy:
    """``with RecordingProxy(target) as proxy``: ``proxy.url`` stands in for ``target``;
    ``proxy.requests`` holds ``(method, path, body)`` in arrival order (the body parsed as
    JSON when it is JSON), and ``proxy.answers`` ``(path, text)``, each answer's whole body
    as it streamed back."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.requests: list[tuple[str, str, Any]] = []
        self.answers: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _record(self, method: str, path: str, raw: bytes) -> None:
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self._lock:
            self.requests.append((method, path, body))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # the test prints what it needs
                pass

            def _forward(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                proxy._record(self.command, self.path, raw)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                # No read timeout: a long prompt's prefill on a small CPU takes minutes.
                timeout = httpx.Timeout(10.0, read=None)
                with (
                    httpx.Client(timeout=timeout) as client,
                    client.stream(
                        self.command, proxy.target + self.path, headers=headers, content=raw
                    ) as answer,
                ):
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in _HOP_BY_HOP:
                            self.send_header(key, value)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    body = bytearray()
                    for chunk in answer.iter_raw():
                        body += chunk
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                with proxy._lock:
                    proxy.answers.append((self.path, body.decode("utf-8", "replace")))

            do_GET = do_POST = do_DELETE = _forward

        return Handler
