"""ASGI middleware: the request id and the optional API key.

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
    ``x-request-id`` response header and names it in every log line of the request."""

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
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the API (``/v1/...``), model management
    (``/models``, ``/models/load``, ``/models/unload``) and admin routes; health, readiness
    and metrics stay open for probes and scrapers. A refusal is a 401 in OpenAI's shape.
    The key is compared in constant time and never logged or echoed."""

    PROTECTED = ("/v1/", "/admin/", "/models")

    def __init__(
        self, app: ASGIApp, api_key: str, on_refused: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self._key = api_key.encode()
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.PROTECTED):
            await self.app(scope, receive, send)
            return
        presented = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
        if presented is not None and hmac.compare_digest(presented, self._key):
            await self.app(scope, receive, send)
            return
        if self._on_refused is not None:
            self._on_refused()
        if presented is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        else:
            message = "Incorrect API key provided."
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
