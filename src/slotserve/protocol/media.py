"""Images named by a request, read into pixels: ``data:`` URLs always; ``http(s)`` URLs only
from the hosts an operator allows, and ``file://`` URLs only under the folder an operator
allows (vLLM's ``--allowed-media-domains`` and ``--allowed-local-media-path``). A server that
fetched any address a request names would let a client reach what only the server can (SSRF).

Reading blocks (a fetch, a decode): callers run it off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from slotserve.engine.errors import InvalidRequestError

MAX_IMAGE_BYTES = 32 * 2**20  # an encoded image, as sent or fetched
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded: more is a decompression bomb, not a photograph
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """How many images a request may carry and where their URLs may point."""

    max_images: int = 8
    allowed_domains: frozenset[str] = frozenset()
    local_path: Path | None = None

    @classmethod
    def of(cls, limit_json: str, domains: tuple[str, ...], local_path: str | None) -> MediaPolicy:
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
        hosts = frozenset(d.lower().strip() for d in domains if d.strip())
        return cls(int(limits.get("image", cls.max_images)), hosts, folder)


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _data_url(url: str, param: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise _refuse("an image data: URL must be base64 (data:image/png;base64,...)", param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise _refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse("the image data: URL is not valid base64", param) from None


def _fetch(url: str, host: str, policy: MediaPolicy, param: str) -> bytes:
    if host not in policy.allowed_domains:
        raise _refuse(
            f"image URLs from {host or 'that address'} are not fetched: the server allows "
            + (
                f"only {', '.join(sorted(policy.allowed_domains))}"
                if policy.allowed_domains
                else "none (start it with --allowed-media-domains); send a data: URL instead"
            ),
            param,
        )
    body = bytearray()
    try:
        # No redirects: one could lead to a host the operator did not allow.
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as reply:
            if reply.status_code != 200:
                raise _refuse(f"fetching the image gave HTTP {reply.status_code}", param)
            for part in reply.iter_bytes():
                body += part
                if len(body) > MAX_IMAGE_BYTES:
                    raise _refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    except httpx.HTTPError as exc:
        raise _refuse(f"the image could not be fetched: {exc}", param) from None
    return bytes(body)


def _local_file(url: str, policy: MediaPolicy, param: str) -> bytes:
    folder = policy.local_path
    if folder is None:
        raise _refuse(
            "file:// image URLs are not read: the server allows no folder "
            "(start it with --allowed-local-media-path)",
            param,
        )
    path = Path(unquote(urlsplit(url).path)).resolve()
    if not path.is_relative_to(folder) or not path.is_file():
        raise _refuse(f"no image file {path} under the allowed folder", param)
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise _refuse(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param)
    return path.read_bytes()


def image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The encoded image a URL names, where the policy allows reading it."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, param)
    if scheme in ("http", "https"):
        return _fetch(url, (urlsplit(url).hostname or "").lower(), policy, param)
    if scheme == "file":
        return _local_file(url, policy, param)
    raise _refuse("an image URL must be a data:, http(s):// or file:// URL", param)


def decode_image(data: bytes, param: str) -> Any:
    """The image as an RGB ``PIL.Image``; a clear refusal for what is not a whole image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise _refuse(
                f"the image is {image.width}x{image.height}: more than "
                f"{MAX_IMAGE_PIXELS // 2**20} Mi pixels",
                param,
            )
        image.load()  # a truncated file fails here, not later in the encoder
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise _refuse(f"the image cannot be decoded: {exc}", param) from None


def read_image(url: str, policy: MediaPolicy, param: str) -> Any:
    """The RGB image a request's URL names (``InvalidRequestError`` otherwise)."""
    return decode_image(image_bytes(url, policy, param), param)
