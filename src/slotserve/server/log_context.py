"""A request id in every log line.

The HTTP middleware puts the request id in a context variable for the duration of the request;
a logging filter copies it into every record (``%(request_id)s``), so lines logged by a route,
the serving code or a library below it all name the request. Lines logged by the engine thread
pass ``extra={"request_id": ...}`` themselves; lines that belong to no request show ``-``.
"""

from __future__ import annotations

import contextvars
import logging

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "slotserve_request_id", default=None
)

LOG_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = current_request_id.get() or "-"
        return True


def configure_logging(level: str) -> None:
    """Root logging for ``slotserve serve``: one stderr handler with the request-id filter
    (uvicorn's loggers propagate to it)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
