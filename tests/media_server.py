"""A real HTTP server on loopback that serves images the way servers on the internet may: an
ordinary picture, a slow one, one trickled a byte at a time, an oversized body, a redirect and
a decompression bomb; and HTML pages a test puts there. Tests of image fetching point URLs at
it, and the browser test serves its pages from it (a local origin of its own)."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from slotserve.protocol.media import MAX_IMAGE_BYTES

TRICKLE_INTERVAL_S = 0.2
SLOW_S = 0.6


def pixel_bomb(width: int = 10_000, height: int = 8_000) -> bytes:
    """A valid PNG header declaring ``width`` x ``height`` pixels over a few bytes of data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


@dataclass
class MediaServer:
    picture: bytes
    host: str = "127.0.0.1"
    port: int = 0
    hits: list[str] = field(default_factory=list)  # paths asked for, in order
    pages: dict[str, bytes] = field(default_factory=dict)  # HTML pages by path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _handler(media: MediaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _head(self, status: int, length: int | None, **headers: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            if length is not None:
                self.send_header("Content-Length", str(length))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()

        def do_GET(self) -> None:
            media.hits.append(self.path)
            path = self.path.split("?")[0]
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if path in media.pages:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(media.pages[path])))
                    self.end_headers()
                    self.wfile.write(media.pages[path])
                elif path == "/picture.png":
                    self._head(200, len(media.picture))
                    self.wfile.write(media.picture)
                elif path == "/slow.png":
                    time.sleep(SLOW_S)
                    self._head(200, len(media.picture))
                    self.wfile.write(media.picture)
                elif path == "/trickle.png":  # a byte at a time, for ever as far as a client knows
                    self._head(200, 10 * len(media.picture))
                    for byte in media.picture * 10:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(TRICKLE_INTERVAL_S)
                elif path == "/huge-declared.png":
                    self._head(200, MAX_IMAGE_BYTES + 1)
                elif path == "/huge.png":  # no length: the body itself passes the cap
                    self._head(200, None, Connection="close")
                    block = b"\0" * 2**20
                    for _ in range(MAX_IMAGE_BYTES // len(block) + 2):
                        self.wfile.write(block)
                elif path == "/redirect.png":
                    self._head(302, 0, Location=f"{media.base_url}/picture.png")
                elif path == "/bomb.png":
                    bomb = pixel_bomb()
                    self._head(200, len(bomb))
                    self.wfile.write(bomb)
                else:
                    self._head(404, 0)

    return Handler


@contextlib.contextmanager
def media_server(picture: bytes, host: str = "127.0.0.1", port: int = 0) -> Iterator[MediaServer]:
    """Serves until the block ends (handler threads are daemons: a trickle left running dies
    with the test process)."""
    media = MediaServer(picture, host)
    httpd = ThreadingHTTPServer((host, port), _handler(media))
    httpd.daemon_threads = True
    media.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, name="media-server", daemon=True)
    thread.start()
    try:
        yield media
    finally:
        httpd.shutdown()
        httpd.server_close()
