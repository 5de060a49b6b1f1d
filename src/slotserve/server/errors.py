"""Error responses and the handlers that produce them: OpenAI's shape, and Anthropic's on
the Messages API routes (``/v1/messages``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.engine.adapters import AdapterNotFoundError
from slotserve.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from slotserve.engine.outputs import FailureKind, RequestOutput
from slotserve.hosting.registry import ModelLoadError, ModelNotFoundError
from slotserve.hosting.served import RELOAD_HINT, ModelUnavailableError, ReloadConflictError

logger = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for the OpenAPI schema."""

    error: ErrorDetail


class GenerationFailed(Exception):
    """The engine ended the request early (``output.failure`` says why)."""

    def __init__(self, output: RequestOutput, timeout_s: float | None) -> None:
        super().__init__(output.error or "the request was ended early")
        self.output = output
        self.timeout_s = timeout_s


def failure_error(
    output: RequestOutput, request_id: str, timeout_s: float | None
) -> tuple[int, str, str, str | None]:
    """The one mapping from why the engine ended a request to ``(status, message, type,
    code)``, for a JSON response and for a stream's error event alike."""
    detail = output.error or "no detail"
    match output.failure:
        case FailureKind.TIMED_OUT:
            limit = f"{timeout_s:g} s" if timeout_s is not None else "its limit"
            message = (
                f"The request did not finish within the server's time limit of {limit} "
                "(--request-timeout) and was cancelled."
            )
            return 408, message, "timeout_error", "request_timeout"
        case FailureKind.MODEL_UNHEALTHY:
            message = (
                f"The model failed while serving this request ({detail}); retry it once the "
                f"engine is restarted (with --engine-restart never: {RELOAD_HINT})."
            )
            return 503, message, "service_unavailable", "model_unhealthy"
        case FailureKind.ENGINE_STOPPED:
            message = f"The request was ended because {detail}; retry it."
            return 503, message, "service_unavailable", "model_unavailable"
        case _:
            message = f"Generation failed: {detail} (request id {request_id})."
            return 500, message, "internal_server_error", None


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class ApiError:
    """One error answer: the HTTP status, OpenAI's error fields and extra headers."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    headers: dict[str, str] | None = None

    def response(self, anthropic: bool = False) -> JSONResponse:
        if anthropic:
            body = anthropic_error_body(self.status, self.anthropic_message())
        else:
            body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, self.status, headers=self.headers)

    def anthropic_message(self) -> str:
        """Anthropic's wording for a prompt, or a prompt plus max_tokens, over the context,
        which clients (Claude Code) parse to compact the conversation or retry with a smaller
        max_tokens; otherwise the message."""
        found = _PROMPT_OVER_CONTEXT.search(self.message)
        if found is not None:
            limit, prompt = found.group("limit", "prompt")
            return (
                f"prompt is too long: {prompt} tokens > {limit} maximum (the context of one "
                "slot of this server: --ctx-size / --slots)"
            )
        found = _OVER_CONTEXT.search(self.message)
        if found is not None:
            limit, prompt, output = found.group("limit", "prompt", "output")
            return (
                f"input length and `max_tokens` exceed context limit: {prompt} + {output} > "
                f"{limit}, decrease input length or `max_tokens` and try again"
            )
        return self.message


# engine/core/limits.py's messages for a prompt, and a prompt plus max_tokens, over the context.
_PROMPT_OVER_CONTEXT = re.compile(
    r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt resulted in "
    r"(?P<prompt>\d+) tokens"
)
_OVER_CONTEXT = re.compile(
    r"maximum context length is (?P<limit>\d+) tokens\. However, you requested \d+ tokens "
    r"\((?P<prompt>\d+) in the prompt, (?P<output>\d+) for the completion\)"
)

# Anthropic's error type for each status; other 4xx are invalid requests, other 5xx api errors.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body; a stream's ``error`` event carries the same."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, for the OpenAPI schema."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    return ApiError(status, message, type_, param, code).response()


def stream_error(exc: GenerationFailed) -> dict[str, Any]:
    """The error a stream ends with when the engine ended its request early; vLLM puts the
    HTTP status a JSON answer would have had in ``code``."""
    status, message, type_, _ = failure_error(exc.output, exc.output.request_id, exc.timeout_s)
    return error_body(message, type_, code=status)


def _input_path(loc: tuple[Any, ...], body: Any) -> str:
    """The error's location as a path into the client's JSON ("messages.0.content"), without
    the union-branch labels pydantic puts in it ("user", "str", "list[TextPart]")."""
    steps = loc[1:] if loc and loc[0] == "body" else loc
    parts, node = [], body
    for i, part in enumerate(steps):
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            node = node[part]
        elif not (isinstance(node, dict) and i == len(steps) - 1):
            continue  # a union label; a dict's last step is a missing field and is kept
        parts.append(str(part))
    return ".".join(parts)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "The request body is not valid JSON.", None
    body = getattr(exc, "body", None)
    located = [(_input_path(tuple(e.get("loc", ())), body), e) for e in errors]
    # The deepest location is the most specific one (inside a union, the branch that matched).
    path, first = max(located, key=lambda item: item[0].count(".") + bool(item[0]))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return f"Unsupported parameter '{path}'.", path or None
    if kind == "missing":
        return f"Missing required parameter '{path}'.", path or None
    return f"Invalid value for '{path}': {first.get('msg', 'invalid')}.", path or None


def request_id_of(request: Request) -> str:
    return str(getattr(request.state, "request_id", "unknown"))


# (status, OpenAI error type, the model the request named when it was found)
ErrorCounter = Callable[[int, str, str | None], None]

_LOAD_ERROR_TYPES = {
    404: "not_found_error",
    409: "conflict_error",
    500: "internal_server_error",
}


def install_error_handlers(app: FastAPI, count: ErrorCounter | None = None) -> None:
    """Maps every exception a route can raise to OpenAI's error shape, or Anthropic's on the
    Messages API routes; ``count(status, type, model)`` sees each error response (the
    ``slotserve:http_errors`` metric, with OpenAI's types on every route)."""

    def respond(request: Request, error: ApiError) -> JSONResponse:
        if count is not None:
            count(error.status, error.type, getattr(request.state, "model_name", None))
        return error.response(anthropic=is_anthropic_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return respond(request, ApiError(400, message, "invalid_request_error", param))

    @app.exception_handler(InvalidRequestError)
    async def _invalid_param(request: Request, exc: InvalidRequestError) -> JSONResponse:
        error = ApiError(400, exc.message, "invalid_request_error", exc.param, exc.code)
        return respond(request, error)

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        error = ApiError(404, str(exc), "invalid_request_error", "model", "model_not_found")
        return respond(request, error)

    @app.exception_handler(AdapterNotFoundError)
    async def _no_adapter(request: Request, exc: AdapterNotFoundError) -> JSONResponse:
        error = ApiError(404, str(exc), "invalid_request_error", "lora_name", "model_not_found")
        return respond(request, error)

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)}
        return respond(
            request, ApiError(429, str(exc), "rate_limit_error", None, "queue_full", headers)
        )

    @app.exception_handler(ModelUnavailableError)
    async def _unavailable(request: Request, exc: ModelUnavailableError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        error = ApiError(503, str(exc), "service_unavailable", None, "model_unavailable", headers)
        return respond(request, error)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        message = f"The model is unhealthy ({exc}); {RELOAD_HINT}."
        error = ApiError(503, message, "service_unavailable", None, "model_unhealthy")
        return respond(request, error)

    @app.exception_handler(GenerationFailed)
    async def _failed(request: Request, exc: GenerationFailed) -> JSONResponse:
        status, message, type_, code = failure_error(
            exc.output, request_id_of(request), exc.timeout_s
        )
        return respond(request, ApiError(status, message, type_, None, code))

    @app.exception_handler(ModelLoadError)
    async def _load_refused(request: Request, exc: ModelLoadError) -> JSONResponse:
        kind = _LOAD_ERROR_TYPES.get(exc.status, "invalid_request_error")
        return respond(request, ApiError(exc.status, str(exc), kind, "model"))

    @app.exception_handler(ReloadConflictError)
    async def _reload_conflict(request: Request, exc: ReloadConflictError) -> JSONResponse:
        return respond(request, ApiError(409, f"Cannot reload now: {exc}.", "conflict_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request_id_of(request)
        logger.exception("request %s failed", request_id)
        message = f"Internal server error (request id {request_id})."
        return respond(request, ApiError(500, message, "internal_server_error"))
