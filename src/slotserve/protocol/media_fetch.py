"""Fetching a request's ``http(s)`` image URLs, on the event loop, before its prompt is rendered
(the rendering threads never wait on a network).

- **A deadline for all of it.** Each URL has ``--media-fetch-timeout`` seconds from the name
  lookup to the body's last byte, and a request's URLs are fetched together within the same
  time; a server that trickles its answer is cut off there, not read for ever.
- **A pool of its own.** At most :data:`MAX_PARALLEL_FETCHES` fetches run at once in the server;
  the others wait their turn within their deadline.
- **Addresses, not names.** The host must be allowed (``MediaPolicy.allows_host``); its name
  is resolved once and every address it gives is checked (``MediaPolicy.allows_address``: no
  loopback, private, link-local, CGNAT, multicast or metadata address unless the operator named
  it); the connection then goes to the checked address, with the name as Host (and as TLS
  server name), so a name rebound between the check and the connection changes nothing.
- No redirects (one could lead anywhere), no proxy from the environment (it would connect by
  name), bodies cut off past ``MAX_IMAGE_BYTES``.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx

from slotserve.protocol.media import (
    MAX_IMAGE_BYTES,
    Address,
    MediaPolicy,
    is_fetched,
    refuse,
)

MAX_PARALLEL_FETCHES = 16

# (host name, port) → its addresses; a stub in tests.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses the system's resolver gives ``host`` (its own threads, not ours)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@functools.cache
def _tls() -> ssl.SSLContext:
    """The certificate store, read once: reading it takes tens of milliseconds, which a client
    made per fetch would spend on the event loop."""
    return httpx.create_ssl_context()


def _pool() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _pools:
        _pools[loop] = asyncio.Semaphore(MAX_PARALLEL_FETCHES)
    return _pools[loop]


async def fetch_images(
    urls: Sequence[tuple[str, str]], policy: MediaPolicy, resolve: Resolver = system_resolve
) -> dict[str, bytes]:
    """The bodies of the ``http(s)`` URLs among ``urls`` ((url, request field) pairs), fetched
    together; ``InvalidRequestError`` naming the field of the first that cannot be, or the
    deadline."""
    wanted = {url: param for url, param in urls if is_fetched(url)}
    if not wanted:
        return {}
    deadline = policy.fetch_timeout_s
    try:
        async with asyncio.timeout(deadline), asyncio.TaskGroup() as group:
            tasks = {
                url: group.create_task(_fetch(url, param, policy, resolve))
                for url, param in wanted.items()
            }
    except TimeoutError:
        raise refuse(
            f"the request's images could not all be fetched within {deadline:g} s "
            "(--media-fetch-timeout)",
            next(iter(wanted.values())),
        ) from None
    except ExceptionGroup as failed:  # the first image that could not be fetched says why
        raise failed.exceptions[0] from None
    return {url: task.result() for url, task in tasks.items()}


async def _fetch(url: str, param: str, policy: MediaPolicy, resolve: Resolver) -> bytes:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if not policy.allows_host(host):
        allowed = sorted(policy.allowed_domains) + [str(n) for n in policy.allowed_networks]
        raise refuse(
            f"image URLs from {host or 'that address'} are not fetched: the server allows "
            + (
                f"only {', '.join(allowed)}"
                if allowed
                else "none (start it with --allowed-media-domains); send a data: URL instead"
            ),
            param,
        )
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    deadline = policy.fetch_timeout_s
    try:
        async with _pool(), asyncio.timeout(deadline):
            address = await _checked_address(host, port, policy, resolve, param)
            return await _download(parts, host, address, port, param)
    except TimeoutError:
        raise refuse(
            f"fetching the image took longer than {deadline:g} s (--media-fetch-timeout)", param
        ) from None


async def _checked_address(
    host: str, port: int, policy: MediaPolicy, resolve: Resolver, param: str
) -> Address:
    """The address to connect to: the host's own where it is one, else the first its name
    resolves to, once every address it resolves to has passed the policy."""
    try:
        addresses: list[Address] = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in await resolve(host, port)]
        except (OSError, ValueError) as exc:
            raise refuse(f"the image's host {host} could not be resolved: {exc}", param) from None
    if not addresses:
        raise refuse(f"the image's host {host} has no address", param)
    for address in addresses:
        if not policy.allows_address(address):
            raise refuse(
                f"the image's host {host} leads to {address}, an address inside a private, "
                "loopback, link-local or metadata range, which is not fetched unless "
                "--allowed-media-domains names it",
                param,
            )
    return addresses[0]


async def _download(
    parts: SplitResult, host: str, address: Address, port: int, param: str
) -> bytes:
    """GET the URL's path from ``address``, naming ``host`` as the server asked for."""
    literal = f"[{address}]" if address.version == 6 else str(address)
    target = urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))
    default_port = port == (443 if parts.scheme.lower() == "https" else 80)
    named = f"[{host}]" if ":" in host else host
    headers = {"host": named if default_port else f"{named}:{port}"}
    extensions = {} if host.strip("[]") == str(address) else {"sni_hostname": host}
    body = bytearray()
    tls = await asyncio.to_thread(_tls)
    try:
        async with (
            httpx.AsyncClient(
                verify=tls, follow_redirects=False, trust_env=False, timeout=None
            ) as client,
            client.stream("GET", target, headers=headers, extensions=extensions) as reply,
        ):
            if reply.status_code != 200:
                redirect = " (redirects are not followed)" if reply.is_redirect else ""
                raise refuse(f"fetching the image gave HTTP {reply.status_code}{redirect}", param)
            length = reply.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_IMAGE_BYTES:
                raise refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
            async for part in reply.aiter_bytes():
                body += part
                if len(body) > MAX_IMAGE_BYTES:
                    raise refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    except httpx.HTTPError as exc:
        raise refuse(f"the image could not be fetched: {exc}", param) from None
    return bytes(body)
