"""A real browser against a real server: headless Chromium (Debian's, installed by ``make
test``) opens a page served from another local port, whose script tries what a hostile page
would: a chat completion (JSON, so preflighted), the same as a "simple" text/plain POST, which
browsers send without asking, ``POST /admin/reload`` and ``POST /flush_cache``. Every attempt
is refused, and nothing changes on the server: no generation, no reload, the cache kept. The
same page served from an origin in ``--allowed-origins`` reads a chat completion through CORS,
and is still refused the admin routes."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.media_server import MediaServer, media_server

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As the machine's own notes start it: no sandbox as root, and nothing that dials out.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",
    "--dump-dom",
)

PAGE = """<html><body><pre id="results"></pre><script>
const server = "%(server)s";
const chat = JSON.stringify({model: "m", max_tokens: 2, temperature: 0,
                             messages: [{role: "user", content: "Say hi"}]});
const attempts = [
  ["chat json", server + "/v1/chat/completions",
   {method: "POST", headers: {"Content-Type": "application/json"}, body: chat}],
  ["chat simple", server + "/v1/chat/completions",
   {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: chat}],
  ["reload", server + "/admin/reload?model=m", {method: "POST", mode: "no-cors"}],
  ["flush", server + "/flush_cache", {method: "POST", mode: "no-cors"}],
  ["flush cors", server + "/flush_cache", {method: "POST"}],
];
async function run() {
  const results = {};
  for (const [name, url, init] of attempts) {
    try {
      const reply = await fetch(url, init);
      results[name] = reply.type === "opaque" ? "opaque" : reply.status + " " + await reply.text();
    } catch (error) {
      results[name] = "failed: " + error;
    }
  }
  document.getElementById("results").textContent = "RESULTS" + JSON.stringify(results);
}
run();
</script></body></html>"""


def _browse(url: str, profile: Path) -> dict[str, str]:
    assert CHROMIUM is not None
    done = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="results">RESULTS(.*?)</pre>', done.stdout, re.S)
    assert found is not None, f"the page did not finish:\n{done.stdout}\n{done.stderr[-2000:]}"
    results: dict[str, str] = json.loads(html.unescape(found.group(1)))
    return results


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _cached_tokens(server: ServerProcess) -> int:
    stats: dict[str, Any] = httpx.get(f"{server.base_url}/v1/prefix_cache_stats", timeout=10).json()
    return int(stats.get("cached_tokens", 0))


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[MediaServer, MediaServer]]:
    """Two local origins to serve the page from: one the server allows, one it does not."""
    with media_server(b"") as hostile, media_server(b"") as allowed:
        yield hostile, allowed


@pytest.fixture(scope="module")
def browser_server(
    tmp_path_factory: pytest.TempPathFactory, pages: tuple[MediaServer, MediaServer]
) -> Iterator[ServerProcess]:
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (make test installs Debian's where it can)")
    proc = start_server(
        tmp_path_factory.mktemp("browser-server"),
        "--slots", "2", "--served-model-name", "m",
        "--allowed-origins", pages[1].base_url,
    )  # fmt: skip
    yield proc
    stop_server(proc)


def _serve_page(page_server: MediaServer, server: ServerProcess) -> str:
    page_server.pages["/attack.html"] = (PAGE % {"server": server.base_url}).encode()
    return f"{page_server.base_url}/attack.html"


def test_a_page_from_another_origin_is_refused_and_changes_nothing(
    browser_server: ServerProcess,
    pages: tuple[MediaServer, MediaServer],
    tmp_path: Path,
) -> None:
    story = " ".join(f"Sentence {i} of a long shared preamble." for i in range(80))
    warm = {"model": "m", "prompt": story, "max_tokens": 2}
    assert httpx.post(f"{browser_server.api_url}/completions", json=warm, timeout=60)
    cached, loads = (
        _cached_tokens(browser_server),
        _metric(browser_server, "slotserve:model_loads_total"),
    )
    served = _metric(browser_server, "vllm:request_success_total")
    assert wait_until(lambda: _cached_tokens(browser_server) > 0, timeout=30)
    cached = _cached_tokens(browser_server)

    results = _browse(_serve_page(pages[0], browser_server), tmp_path / "profile")
    assert results["chat json"].startswith("failed"), results  # the preflight was refused
    assert results["flush cors"].startswith("failed"), results
    assert _cached_tokens(browser_server) == cached  # no flush
    assert _metric(browser_server, "slotserve:model_loads_total") == loads  # no reload
    assert _metric(browser_server, "vllm:request_success_total") == served  # no generation


def test_a_page_from_an_allowed_origin_reads_a_chat_but_not_the_admin_routes(
    browser_server: ServerProcess,
    pages: tuple[MediaServer, MediaServer],
    tmp_path: Path,
) -> None:
    cached, loads = (
        _cached_tokens(browser_server),
        _metric(browser_server, "slotserve:model_loads_total"),
    )
    results = _browse(_serve_page(pages[1], browser_server), tmp_path / "profile")
    status, _, body = results["chat json"].partition(" ")
    assert status == "200", results
    assert json.loads(body)["choices"][0]["message"]["content"]
    assert results["flush cors"].startswith("403"), results
    assert _cached_tokens(browser_server) >= cached
    assert _metric(browser_server, "slotserve:model_loads_total") == loads
