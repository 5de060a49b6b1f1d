"""Who may call the admin routes: reloading an engine, loading and unloading models, flushing
the prefix cache. Safe by default: without a key they are open only on a loopback bind, where
only this machine reaches them; bound anywhere else, they answer 403 naming the flags.

| keys / bind                      | admin routes                                          |
|----------------------------------|-------------------------------------------------------|
| ``--admin-api-key``              | that key only (``--api-key`` does not open them)      |
| ``--api-key`` only               | that key, as every other guarded route                |
| no key, loopback bind            | open (local use)                                      |
| no key, any other bind           | 403, unless ``--admin-routes open``                   |
| ``--admin-routes off``           | 403 whatever the keys                                 |
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from slotserve.serve_config import ADMIN_ROUTES
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

ADMIN_PREFIXES = (
    "/admin/",
    "/models/load",
    "/models/unload",
    "/flush_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens only to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: whatever it resolves to, other machines may reach it
        return False


@dataclass(frozen=True)
class AdminAccess:
    """The rule in force (the table above), decided once at start-up."""

    rule: str  # "admin key", "api key", "open", "refused", "off"
    host: str
    admin_key: str | None = None

    @property
    def decides_alone(self) -> bool:
        """Whether this rule alone decides the admin routes (else the API key guards them)."""
        return self.rule != "api key"

    @property
    def refusal(self) -> str:
        if self.rule == "off":
            return "The admin routes are turned off on this server (--admin-routes off)."
        return (
            f"The admin routes are refused on a server bound to {self.host} without a key: "
            "set --admin-api-key (or --api-key), or --admin-routes open to let anyone who "
            "reaches the port reload, load and unload models."
        )

    def describe(self) -> str:
        """One log line: which admin routes are open to whom."""
        routes = ", ".join(
            p.rstrip("/") + ("/*" if p.endswith("/") else "") for p in ADMIN_PREFIXES
        )
        whom = {
            "admin key": "callers with the admin key (--admin-api-key)",
            "api key": "callers with the API key (--api-key; --admin-api-key sets one apart)",
            "open": f"anyone who reaches {self.host}",
            "refused": f"nobody: bound to {self.host} without a key (403)",
            "off": "nobody (--admin-routes off)",
        }[self.rule]
        return f"admin routes ({routes}): {whom}"


# An embedded server's default (tests, in-process use): the loopback rule.
LOOPBACK_OPEN = AdminAccess("open", "127.0.0.1")


def admin_access(
    host: str, api_key: str | None, admin_api_key: str | None, admin_routes: str
) -> AdminAccess:
    if admin_routes not in ADMIN_ROUTES:
        raise ValueError(f"--admin-routes must be one of {', '.join(ADMIN_ROUTES)}")
    if admin_routes == "off":
        return AdminAccess("off", host)
    if admin_api_key:
        return AdminAccess("admin key", host, admin_api_key)
    if api_key:
        return AdminAccess("api key", host)
    if admin_routes == "open" or is_loopback(host):
        return AdminAccess("open", host)
    return AdminAccess("refused", host)


class AdminAccessMiddleware:
    """Applies an :class:`AdminAccess` to the admin routes: a 401 without the admin key where
    one is set, a 403 where the routes are refused or off; the rest passes through (the API
    key, if any, is ``ApiKeyMiddleware``'s)."""

    def __init__(self, app: ASGIApp, access: AdminAccess) -> None:
        self.app = app
        self._access = access
        self._admin_key = access.admin_key.encode() if access.admin_key else b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        rule = self._access.rule
        if scope["type"] != "http" or not path.startswith(ADMIN_PREFIXES):
            await self.app(scope, receive, send)
        elif rule in ("refused", "off"):
            await send_refusal(send, path, 403, self._access.refusal, "admin_routes_refused")
        elif rule == "admin key" and not holds_key(presented_keys(scope), self._admin_key):
            await refuse_key(send, path, presented_keys(scope), "admin API key")
        else:
            await self.app(scope, receive, send)
