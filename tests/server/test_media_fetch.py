"""Image URLs fetched against real HTTP servers on loopback: the deadline holds against a server
that trickles, the URLs of one request are fetched together, the size and pixel caps and the
no-redirect rule hold, and addresses are checked after the name is resolved, once: an internal
address is refused unless the operator named it, and a name rebound after the check changes
nothing."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from slotserve.engine.errors import InvalidRequestError
from slotserve.protocol.media import MediaPolicy, decode_image
from slotserve.protocol.media_fetch import fetch_images
from tests.media_server import SLOW_S, MediaServer, media_server


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), (seed * 40 % 256, 90, 200)).save(out, format="PNG")
    return out.getvalue()


PICTURE = _png(1)


def _policy(*domains: str, timeout: float = 1.0) -> MediaPolicy:
    return MediaPolicy.of('{"image": 8}', domains, None, timeout)


def _fetch(urls: list[str], policy: MediaPolicy, resolve: object = None) -> dict[str, bytes]:
    pairs = [(url, f"messages.0.content.{i}.image_url") for i, url in enumerate(urls)]
    if resolve is None:
        return asyncio.run(fetch_images(pairs, policy))
    return asyncio.run(fetch_images(pairs, policy, resolve))  # type: ignore[arg-type]


def _refusal(urls: list[str], policy: MediaPolicy, resolve: object = None) -> str:
    with pytest.raises(InvalidRequestError) as refused:
        _fetch(urls, policy, resolve)
    assert refused.value.param is not None and refused.value.param.startswith("messages.0.content")
    return str(refused.value)


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with media_server(PICTURE) as served:
        yield served


def test_an_allowed_address_is_fetched(media: MediaServer) -> None:
    url = f"{media.base_url}/picture.png"
    assert _fetch([url], _policy("127.0.0.1")) == {url: PICTURE}
    assert _fetch([url], _policy("127.0.0.0/8")) == {url: PICTURE}  # a range named


def test_a_trickling_server_is_cut_off_at_the_deadline(media: MediaServer) -> None:
    started = time.monotonic()
    message = _refusal([f"{media.base_url}/trickle.png"], _policy("127.0.0.1", timeout=1.0))
    assert time.monotonic() - started < 1.5
    assert "--media-fetch-timeout" in message


def test_the_urls_of_one_request_are_fetched_together(media: MediaServer) -> None:
    urls = [f"{media.base_url}/slow.png?{i}" for i in range(4)]
    started = time.monotonic()
    fetched = _fetch(urls, _policy("127.0.0.1", timeout=3 * SLOW_S))
    assert time.monotonic() - started < 2 * SLOW_S  # one after another would take 4
    assert list(fetched.values()) == [PICTURE] * 4


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/huge-declared.png", "larger than"),
        ("/huge.png", "larger than"),
        ("/redirect.png", "HTTP 302 (redirects are not followed)"),
        ("/missing.png", "HTTP 404"),
    ],
)
def test_bodies_past_the_cap_and_redirects_are_refused(
    media: MediaServer, path: str, words: str
) -> None:
    assert words in _refusal([f"{media.base_url}{path}"], _policy("127.0.0.1", timeout=10))


def test_a_pixel_bomb_is_refused_before_it_is_decoded(media: MediaServer) -> None:
    url = f"{media.base_url}/bomb.png"
    bomb = _fetch([url], _policy("127.0.0.1"))[url]
    with pytest.raises(InvalidRequestError, match="Mi pixels"):
        decode_image(bomb, "messages.0.content.0.image_url")


def test_hosts_not_allowed_are_never_contacted(media: MediaServer) -> None:
    hits = len(media.hits)
    assert "not fetched" in _refusal([f"{media.base_url}/picture.png"], _policy())
    assert "allows only images.test" in _refusal(
        [f"{media.base_url}/picture.png"], _policy("images.test")
    )
    assert len(media.hits) == hits


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.7", "169.254.169.254", "100.64.0.1", "::1", "fd00:ec2::254", "0.0.0.0"],
)
def test_an_allowed_name_that_resolves_inside_is_refused(address: str) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["93.184.215.14", address]  # one public address beside an inside one

    message = _refusal(["http://images.test/picture.png"], _policy("images.test"), resolve)
    assert f"leads to {address}" in message and "--allowed-media-domains" in message


def test_a_name_rebound_after_the_check_is_not_resolved_again(media: MediaServer) -> None:
    """The resolver answers the allowed address once, then an inside one (a DNS rebinding):
    the fetch resolves once and connects to the address it checked."""
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"] if len(calls) == 1 else ["10.0.0.7"]

    url = f"http://images.test:{media.port}/picture.png"
    hits = len(media.hits)
    fetched = _fetch([url], _policy("images.test", "127.0.0.1"), rebinding)
    assert fetched == {url: PICTURE} and calls == ["images.test"]
    assert media.hits[hits:] == ["/picture.png"]


def test_the_deadline_counts_the_name_lookup_too() -> None:
    async def stalled(host: str, port: int) -> list[str]:
        await asyncio.sleep(30)
        return []

    started = time.monotonic()
    message = _refusal(["http://images.test/x.png"], _policy("images.test", timeout=0.5), stalled)
    assert time.monotonic() - started < 1.5 and "--media-fetch-timeout" in message
