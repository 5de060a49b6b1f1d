"""ASGI middleware: the request id and the request size limit, and the pieces the access rules'
refusals share (``access_middleware.py``).

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``: nothing is buffered, so streamed
responses and client disconnects pass straight through.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from slotserve.server.errors import anthropic_error_body, error_body, is_anthropic_path
from slotserve.server.log_context import current_request_id

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A client's id is echoed in headers and logs: keep it printable and short.
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Gives every request an id (the client's ``x-request-id`` or a new one), echoes it in the
    ``x-request-id`` response header (and ``request-id``, where Anthropic's clients read it, on
    the Messages API) and names it in every log line of the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                request_id = candidate if _CLIENT_ID.match(candidate) else ""
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        headers = [(b"x-request-id", request_id.encode("latin-1"))]
        if is_anthropic_path(scope.get("path", "")):
            headers.append((b"request-id", request_id.encode("latin-1")))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *headers]
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request offers: ``Authorization: Bearer <key>`` and Anthropic's
    ``x-api-key: <key>`` (SDKs set one and may leave a placeholder in the other)."""
    presented: list[bytes] = []
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                presented.append(token.strip())
        elif name == b"x-api-key":
            presented.append(value.strip())
    return presented


def holds_key(presented: list[bytes], key: bytes) -> bool:
    """Whether any presented key is ``key``, compared in constant time."""
    return any(hmac.compare_digest(candidate, key) for candidate in presented)


async def refuse_key(send: Send, path: str, presented: list[bytes], what: str) -> None:
    """A 401 for a missing or wrong key; the key is never logged or echoed."""
    if not presented:
        message = (
            f"You didn't provide an {what}. You need to provide your {what} in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY) "
            "or in an x-api-key header."
        )
    else:
        message = f"Incorrect {what} provided."
    await send_refusal(
        send, path, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")]
    )


class BodyLimitMiddleware:
    """Refuses a request body larger than ``limit()`` bytes with a 413 (OpenAI's error shape,
    or Anthropic's ``request_too_large`` on the Messages API) before any of it is parsed: at
    once when ``Content-Length`` says so, else as soon as the chunks that arrived pass the
    limit. Nothing is buffered here; the server discards the rest of the upload."""

    def __init__(
        self, app: ASGIApp, limit: Callable[[], int], on_refused: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self._limit = limit
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit()
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(scope, send, limit)
                return
        received = 0
        refused = started = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await self._refuse(scope, send, limit)
                    # The app stops reading as if the client had left.
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise  # else: the app's complaint about the cut-off body, already answered

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        if self._on_refused is not None:
            self._on_refused()
        message = (
            f"The request body is larger than this server accepts ({limit} bytes, "
            "--max-request-bytes)."
        )
        await send_refusal(send, scope.get("path", ""), 413, message, "request_too_large")


async def send_refusal(
    send: Send,
    path: str,
    status: int,
    message: str,
    code: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A refusal answered by the middleware itself, before any route: Anthropic's error body on
    the Messages API, OpenAI's elsewhere (as the error handlers choose)."""
    if is_anthropic_path(path):
        payload = anthropic_error_body(status, message)
    else:
        payload = error_body(message, "invalid_request_error", None, code)
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
