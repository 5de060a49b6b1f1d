"""Images named by a request, read into pixels: ``data:`` URLs always; ``http(s)`` URLs only
from the hosts an operator allows (fetched by ``media_fetch.py``), and ``file://`` URLs only
under the folder an operator allows (vLLM's ``--allowed-media-domains`` and
``--allowed-local-media-path``). A server that fetched any address a request names would let a
client reach what only the server can (SSRF).

Reading a file and decoding block: callers run them off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from slotserve.engine.errors import InvalidRequestError

MAX_IMAGE_BYTES = 32 * 2**20  # an encoded image, as sent or fetched
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded: more is a decompression bomb, not a photograph
FETCH_TIMEOUT_S = 10.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def public(address: Address) -> bool:
    """Whether ``address`` is on the internet at large: not loopback, private, link-local
    (cloud metadata's 169.254.169.254), CGNAT, multicast, reserved or unspecified."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class MediaPolicy:
    """How many images a request may carry, where their URLs may point and how long a fetch
    may take. ``allowed_domains``: host names and address literals as URLs write them;
    ``allowed_networks``: the addresses and ranges the operator named, which a URL may reach
    even where they are not public."""

    max_images: int = 8
    allowed_domains: frozenset[str] = frozenset()
    allowed_networks: tuple[Network, ...] = ()
    local_path: Path | None = None
    fetch_timeout_s: float = FETCH_TIMEOUT_S

    @classmethod
    def of(
        cls,
        limit_json: str,
        domains: tuple[str, ...],
        local_path: str | None,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
    ) -> MediaPolicy:
        """From the options; ``ValueError`` naming the one at fault."""
        try:
            limits = json.loads(limit_json)
        except json.JSONDecodeError:
            limits = None
        if (
            not isinstance(limits, dict)
            or set(limits) - {"image"}
            or not all(isinstance(v, int) and v >= 0 for v in limits.values())
        ):
            raise ValueError(
                f'--limit-mm-per-prompt must be JSON such as {{"image": 4}}, not {limit_json!r} '
                "(images are the only modality served)"
            )
        folder = Path(local_path).resolve() if local_path else None
        if folder is not None and not folder.is_dir():
            raise ValueError(f"--allowed-local-media-path: {local_path} is not a folder")
        if not fetch_timeout_s > 0:
            raise ValueError("--media-fetch-timeout must be more than 0 seconds")
        names: set[str] = set()
        networks: list[Network] = []
        for domain in (d.lower().strip() for d in domains if d.strip()):
            try:
                network = ipaddress.ip_network(domain.strip("[]"), strict=False)
            except ValueError:
                names.add(domain)
                continue
            networks.append(network)
            if network.num_addresses == 1:  # an address: URLs may write it as their host
                names.add(str(network.network_address))
        images = int(limits.get("image", cls.max_images))
        return cls(images, frozenset(names), tuple(networks), folder, fetch_timeout_s)

    def allows_host(self, host: str) -> bool:
        """Whether a URL naming ``host`` (a name, or an address in a named range) is fetched."""
        host = host.strip("[]")
        if host in self.allowed_domains:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.allowed_networks)

    def allows_address(self, address: Address) -> bool:
        """Whether a fetch may connect to ``address``: a public one, or one the operator named."""
        return public(address) or any(address in network for network in self.allowed_networks)


def refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _data_url(url: str, param: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise refuse("an image data: URL must be base64 (data:image/png;base64,...)", param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise refuse("the image data: URL is not valid base64", param) from None


def _local_file(url: str, policy: MediaPolicy, param: str) -> bytes:
    folder = policy.local_path
    if folder is None:
        raise refuse(
            "file:// image URLs are not read: the server allows no folder "
            "(start it with --allowed-local-media-path)",
            param,
        )
    path = Path(unquote(urlsplit(url).path)).resolve()
    if not path.is_relative_to(folder) or not path.is_file():
        raise refuse(f"no image file {path} under the allowed folder", param)
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    return path.read_bytes()


def is_fetched(url: str) -> bool:
    """Whether ``url`` is read over the network (``media_fetch.py``), not from the request or
    a local file."""
    return urlsplit(url).scheme.lower() in ("http", "https")


def image_bytes(url: str, policy: MediaPolicy, param: str, fetched: Mapping[str, bytes]) -> bytes:
    """The encoded image a URL names, where the policy allows reading it; ``fetched``: the
    bodies of the request's http(s) URLs, fetched beforehand."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, param)
    if is_fetched(url):
        return fetched[url]
    if scheme == "file":
        return _local_file(url, policy, param)
    raise refuse("an image URL must be a data:, http(s):// or file:// URL", param)


def decode_image(data: bytes, param: str) -> Any:
    """The image as an RGB ``PIL.Image``; a clear refusal for what is not a whole image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise refuse(
                f"the image is {image.width}x{image.height}: more than "
                f"{MAX_IMAGE_PIXELS // 2**20} Mi pixels",
                param,
            )
        image.load()  # a truncated file fails here, not later in the encoder
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise refuse(f"the image cannot be decoded: {exc}", param) from None


def read_image(url: str, policy: MediaPolicy, param: str, fetched: Mapping[str, bytes]) -> Any:
    """The RGB image a request's URL names (``InvalidRequestError`` otherwise)."""
    return decode_image(image_bytes(url, policy, param, fetched), param)
