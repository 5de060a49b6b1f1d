"""Client connections: idle and slow clients must neither exhaust the process nor block others.

- Every connection holds a file descriptor. Under a shell's usual soft limit (1,024) a thousand
  idle clients take them all: ``accept()`` then fails and every new client, ``/health``
  included, is dropped. :func:`raise_open_file_limit` lifts the soft limit to the hard one at
  start, as vLLM and SGLang do.
- uvicorn closes a keep-alive connection left idle for ``timeout_keep_alive`` seconds, but
  arms that timer only once it has answered a request on it: a client that connects and never
  sends a byte holds its descriptor forever. :class:`HttpProtocol` arms it as the connection
  opens.
- ``KEEP_ALIVE_S`` outlasts every Retry-After the server sends: at uvicorn's default (5 s, the
  Retry-After of a model loading) the server closed a connection just as a client that had
  waited as told sent its next request on it, which then failed (the soak caught it).

A slow client (a body trickling in a byte a second) costs a connection and a coroutine waiting
on it, never the event loop; ``--max-request-bytes`` bounds what it may send.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from slotserve.hosting.served import LOADING_RETRY_AFTER_S

logger = logging.getLogger(__name__)

OPEN_FILES_TARGET = 65536  # a hard limit of "unlimited" is lifted this far
KEEP_ALIVE_S = 2 * LOADING_RETRY_AFTER_S  # seconds an idle connection is kept


def raise_open_file_limit() -> int | None:
    """Raises this process's soft limit on open files to its hard limit
    (``OPEN_FILES_TARGET`` when that is unlimited); returns the soft limit now in force (None:
    no such limit here). The engine processes started later inherit it."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning(
                "could not raise the open-file limit from %d to %d: %s", soft, target, exc
            )
    return soft


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol (httptools), whose keep-alive timer runs from the connection's
    start: a client silent for ``timeout_keep_alive`` seconds after connecting is closed as an
    idle keep-alive one is. Its first byte cancels the timer (``data_received``)."""

    def connection_made(  # type: ignore[override]
        self, transport: asyncio.Transport
    ) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
