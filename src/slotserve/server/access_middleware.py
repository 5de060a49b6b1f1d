"""Applies :class:`~slotserve.server.access.AccessPolicy` to every request, before any route:
the Host (DNS rebinding), the Origin (cross-site requests), then the route's guard from
``route_guards.py`` (the API key, or the admin rule). Refusals are answered here, in the API's
own error shape: 403 for a Host, an Origin or an admin caller refused, 401 for a missing or
wrong key. Browsers' CORS preflights from allowed origins are Starlette's ``CORSMiddleware``'s,
outside this one."""

from __future__ import annotations

from collections.abc import Callable

from slotserve.server.access import FORWARDING_HEADERS, AccessPolicy, host_name, is_loopback
from slotserve.server.middleware import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    holds_key,
    presented_keys,
    refuse_key,
    send_refusal,
)
from slotserve.server.route_guards import Guard, guard_of


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


def own_origin(scope: Scope) -> str:
    """The origin a page served by this server would have, as the request reached it."""
    return f"{scope.get('scheme', 'http')}://{(_header(scope, b'host') or '').lower()}"


def not_local(scope: Scope) -> str | None:
    """How the request shows it is not a local caller's (None: it is one)."""
    client = scope.get("client")
    if client is None or not is_loopback(str(client[0])):
        return f"from {client[0] if client else 'an unknown address'}"
    for name, _ in scope.get("headers", ()):
        if name in FORWARDING_HEADERS:
            return f"through a proxy (it carries {name.decode()})"
    host = _header(scope, b"host")
    if host is None or not is_loopback(host_name(host)):
        return f"for the name {host!r}" if host else "without a Host header"
    origin = _header(scope, b"origin")
    if origin is not None and origin.strip().lower().rstrip("/") != own_origin(scope):
        return f"from a web page at {origin}"
    if (_header(scope, b"sec-fetch-site") or "none") not in ("none", "same-origin"):
        return "from a web page on another site"
    return None


class AccessMiddleware:
    """See the module's docstring. ``on_refused_key``: counts a 401 (the error metrics)."""

    def __init__(
        self,
        app: ASGIApp,
        policy: AccessPolicy,
        on_refused_key: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self._policy = policy
        self._on_refused_key = on_refused_key
        self._api_key = (policy.api_key or "").encode()
        self._admin_key = (policy.admin_key or "").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._browser_refusal(scope)
        path = scope.get("path", "")
        if refusal is not None:
            await send_refusal(send, path, 403, *refusal)
            return
        guard = guard_of(path)
        admin_keyed = guard is Guard.ADMIN and bool(self._admin_key)
        key = self._admin_key if admin_keyed else self._api_key
        if guard is Guard.ADMIN and self._policy.admin_rule in ("off", "local"):
            why = "off" if self._policy.admin_rule == "off" else not_local(scope)
            if why is not None:
                message = self._policy.admin_refusal(why)
                await send_refusal(send, path, 403, message, "admin_routes_refused")
                return
        elif guard is not Guard.PUBLIC and key and not holds_key(presented_keys(scope), key):
            if self._on_refused_key is not None:
                self._on_refused_key()
            what = "admin API key" if admin_keyed else "API key"
            await refuse_key(send, path, presented_keys(scope), what)
            return
        await self.app(scope, receive, send)

    def _browser_refusal(self, scope: Scope) -> tuple[str, str] | None:
        """(message, code) refusing a Host or an Origin this server does not answer."""
        host = _header(scope, b"host")
        if not self._policy.host_allowed(host):
            return (
                f"This server answers requests for loopback names only, not for {host!r}: a "
                "page that reached it by another name is refused (DNS rebinding). Name the "
                "hosts it is reached by with --allowed-hosts.",
                "host_not_allowed",
            )
        origin = _header(scope, b"origin")
        if origin is not None and not self._policy.origin_allowed(origin, own_origin(scope)):
            return (
                f"Requests from web pages at {origin} are refused: allow that origin with "
                "--allowed-origins (vLLM's CORS flag).",
                "origin_not_allowed",
            )
        return None
