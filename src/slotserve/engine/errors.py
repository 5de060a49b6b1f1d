"""Exceptions the engine raises towards its callers (the HTTP layer maps them to status codes)."""


class EngineError(Exception):
    """Base class for errors raised by the engine."""


class InvalidRequestError(EngineError):
    """A request parameter is out of range or unsupported; ``param`` names the field and
    ``code`` is OpenAI's machine-readable code when there is one (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class QueueFullError(EngineError):
    """The bounded admission queue is full; the caller should retry later."""

    def __init__(self, max_queue: int, retry_after_s: int = 1) -> None:
        super().__init__(f"The server is busy: the waiting queue is full ({max_queue} requests).")
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine no longer serves: its runner failed (the model is unhealthy until reloaded)
    or its loop stopped. ``str(error)`` says why."""


class RunnerFailure(EngineError):
    """A runner's forward pass produced something unusable (non-finite logits): the device or
    the weights are in a bad state, so the model must be reloaded."""
