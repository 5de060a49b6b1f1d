"""Exceptions the engine raises towards its callers (the HTTP layer maps them to status codes)."""


class EngineError(Exception):
    """Base class for errors raised by the engine."""


class InvalidRequestError(EngineError):
    """A request parameter is out of range or unsupported; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class QueueFullError(EngineError):
    """The bounded admission queue is full; the caller should retry later."""

    def __init__(self, max_queue: int, retry_after_s: int = 1) -> None:
        super().__init__(f"The server is busy: the waiting queue is full ({max_queue} requests).")
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine loop has stopped; no request can be served."""
