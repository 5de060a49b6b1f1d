"""Who may call what: the keys, the admin rule, and the browser rules (Host and Origin).

Admin routes (``route_guards.py``: reload, load and unload models and adapters, flush the
cache) are decided by who asks, not by where the server listens:

| keys / ``--admin-routes``     | admin routes                                                  |
|-------------------------------|---------------------------------------------------------------|
| ``--admin-api-key``           | that key only (``--api-key`` does not open them)              |
| ``--api-key`` only            | that key, as every other guarded route                        |
| no key, ``auto`` (default)    | callers on this machine only: a loopback peer, no forwarding  |
|                               | header, a loopback Host, no Origin but the server's own       |
| no key, ``open``              | anyone who reaches the port                                   |
| ``off``                       | nobody, whatever the keys                                     |

A local reverse proxy, tunnel or sidecar turns remote callers into loopback peers; it adds a
forwarding header (or the Host it was reached by), so the ``auto`` rule refuses what it relays:
behind one, set a key. A web page the local user opens reaches loopback too: its requests carry
its Origin, and with DNS rebinding its own Host name.

Every route on a loopback bind (or any bind given ``--allowed-hosts``) answers only a Host that
is a loopback name or address or one of ``--allowed-hosts``; a browser request whose Origin is
neither the server's own nor one of ``--allowed-origins`` is refused on every bind.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from slotserve.serve_config import ADMIN_ROUTES, ServerConfig

FORWARDING_HEADERS = (
    b"forwarded",
    b"x-forwarded-for",
    b"x-forwarded-host",
    b"x-real-ip",
    b"via",
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, as bound or as a Host header names it) is this
    machine alone: ``localhost``, a ``.localhost`` name (RFC 6761) or a loopback address."""
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.strip("[]"))
    except ValueError:  # a name: whatever it resolves to, other machines may reach it
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def host_name(header: str) -> str:
    """The name or address of a Host header, without its port (``[::1]:8000`` → ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def listed(values: Iterable[str]) -> tuple[str, ...]:
    """Values from repeated flags, any of which may be vLLM's JSON list (``'["a", "b"]'``)
    or a comma-separated list."""
    found: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"not a JSON list of strings: {value!r}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"not a JSON list of strings: {value!r}")
            found += [i.strip() for i in items if i.strip()]
        else:
            found += [part.strip() for part in text.split(",") if part.strip()]
    return tuple(found)


@dataclass(frozen=True)
class AccessPolicy:
    """The rules in force, decided once at start-up (the table above)."""

    bind: str = "127.0.0.1"
    api_key: str | None = None
    admin_key: str | None = None
    admin_routes: str = "auto"
    allowed_hosts: tuple[str, ...] = ()  # besides loopback names; "*": any Host
    allowed_origins: tuple[str, ...] = ()  # besides the server's own; "*": any Origin

    def __post_init__(self) -> None:
        if self.admin_routes not in ADMIN_ROUTES:
            raise ValueError(f"--admin-routes must be one of {', '.join(ADMIN_ROUTES)}")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and not (parts.scheme and parts.netloc and not parts.path):
                raise ValueError(
                    f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *"
                )

    @property
    def admin_rule(self) -> str:
        """``off``, ``admin key``, ``api key``, ``open`` or ``local``."""
        if self.admin_routes == "off":
            return "off"
        if self.admin_key:
            return "admin key"
        if self.api_key:
            return "api key"
        return "open" if self.admin_routes == "open" else "local"

    @property
    def checks_host(self) -> bool:
        """Whether the Host header is checked: on a loopback bind, or where hosts are named."""
        named = bool(self.allowed_hosts)
        return "*" not in self.allowed_hosts and (is_loopback(self.bind) or named)

    def host_allowed(self, header: str | None) -> bool:
        if not self.checks_host or header is None:
            return True  # no Host (HTTP/1.0): no browser sends such a request
        name = host_name(header)
        return is_loopback(name) or name in {h.lower() for h in self.allowed_hosts}

    def origin_allowed(self, origin: str, own: str) -> bool:
        """Whether a browser page at ``origin`` may call: the server's own origin (``own``,
        from the request's scheme and Host), else one ``--allowed-origins`` names."""
        origin = origin.strip().lower().rstrip("/")
        if origin == own.lower():
            return True
        return "*" in self.allowed_origins or origin in {
            o.lower().rstrip("/") for o in self.allowed_origins
        }

    def admin_refusal(self, why: str) -> str:
        """The 403's message: ``why`` says how the request was not a local caller's."""
        if self.admin_rule == "off":
            return "The admin routes are turned off on this server (--admin-routes off)."
        return (
            f"The admin routes answer callers on this machine only, and this request came "
            f"{why}: set --admin-api-key (or --api-key) and send the key, or --admin-routes "
            "open to let anyone who reaches the port reload, load and unload models."
        )

    def describe(self, admin_paths: list[str]) -> str:
        """One log line: which admin routes are open to whom, and the browser rules."""
        whom = {
            "admin key": "callers with the admin key (--admin-api-key)",
            "api key": "callers with the API key (--api-key; --admin-api-key sets one apart)",
            "open": f"anyone who reaches {self.bind}",
            "local": "callers on this machine, not through a proxy or a web page (no key set)",
            "off": "nobody (--admin-routes off)",
        }[self.admin_rule]
        hosts = (
            "loopback names" + "".join(f", {h}" for h in self.allowed_hosts)
            if self.checks_host
            else "any"
        )
        origins = ", ".join(self.allowed_origins) or "none but the server's own"
        return (
            f"admin routes ({', '.join(admin_paths)}): {whom}; Host: {hosts}; "
            f"browser origins: {origins}"
        )


# An embedded server's default (tests, in-process use): loopback, no keys.
LOCAL = AccessPolicy()


def access_policy(server: ServerConfig) -> AccessPolicy:
    """The policy ``slotserve serve``'s flags set; ``ValueError`` naming a bad one."""
    try:
        hosts, origins = listed(server.allowed_hosts), listed(server.allowed_origins)
    except ValueError as exc:
        raise ValueError(f"--allowed-hosts / --allowed-origins: {exc}") from None
    return AccessPolicy(
        server.host,
        server.api_key or None,
        server.admin_api_key or None,
        server.admin_routes,
        hosts,
        origins,
    )
