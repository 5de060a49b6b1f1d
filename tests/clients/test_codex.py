"""Codex CLI (``@openai/codex`` from npm, in ``.clients/``) completing one ``codex exec`` turn
against a spawned server through the Responses API, with a recording proxy between them so a
failure shows what Codex sent. Run by ``make clients``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients.recording_proxy import RecordingProxy
from tests.conftest import ServerProcess, start_server, stop_server

pytestmark = pytest.mark.clients

# How Codex reports a turn the model ended badly, not a request it could not make or read.
_MODEL_ENDING = re.compile(
    r"Incomplete response returned, reason: max_output_tokens"
    r"|ran out of room in the model's context window"
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CODEX = Path(__file__).resolve().parents[2] / ".clients" / "node_modules" / ".bin" / "codex"
# Codex's first request is about 8,800 tokens (instructions, tool schemas, environment): past
# the 4,096 a slot holds by default, so one slot gets 16,384 (llama.cpp warns that this is
# beyond SmolLM2's trained 8,192; the turn still completes).
CONTEXT = ["--slots", "1", "--ctx-size", "16384"]
# Prefill of that prompt on a small CPU takes minutes; later requests reuse it.
TURN_TIMEOUT_S = 1500


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[ServerProcess]:
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX} (run `make clients`)")
    # The PyTorch runner reads --ctx-size / --slots as its --max-model-len.
    runner = ("--runner", request.param)
    proc = start_server(tmp_path_factory.mktemp("codex"), *CONTEXT, *runner)
    yield proc
    stop_server(proc)


def _config(base_url: str) -> str:
    return f"""\
model = "{MODEL}"
model_provider = "slotserve"

[model_providers.slotserve]
name = "slotserve"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "SLOTSERVE_API_KEY"
# Codex gives up on a stream silent for 5 minutes; the first prefill can take longer here.
stream_idle_timeout_ms = {TURN_TIMEOUT_S * 1000}
"""


def _generated_text(stream: str) -> str:
    """The text of a Responses stream's completed response: its messages' text and its tool
    calls' arguments ("" when the stream holds no ``response.completed``)."""
    for line in stream.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line.removeprefix("data: "))
        if event.get("type") != "response.completed":
            continue
        texts = [
            part.get("text", "")
            for item in event["response"]["output"]
            for part in item.get("content") or ()
        ]
        texts += [item.get("arguments", "") for item in event["response"]["output"]]
        return "".join(texts).strip()
    return ""


def test_codex_exec_completes_a_turn(server: ServerProcess, tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with RecordingProxy(server.base_url) as proxy:
        (home / "config.toml").write_text(_config(proxy.url))
        env = {**os.environ, "CODEX_HOME": str(home), "SLOTSERVE_API_KEY": "unused"}
        # exec never asks for approval; the read-only sandbox keeps a tool call harmless.
        done = subprocess.run(
            [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "say hi"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TURN_TIMEOUT_S,
        )
    output = done.stdout + done.stderr
    sent = [(method, path) for method, path, _ in proxy.requests]
    # A turn is proved by what the server generated, not by how Codex ended it: at least one
    # response completed with text (a message or a tool call's arguments) in it.
    generated = [_generated_text(text) for path, text in proxy.answers if path == "/v1/responses"]
    assert any(generated), f"no response completed with generated text; {sent}:\n{output[-4000:]}"
    if done.returncode != 0:
        # Past its trained context the 135M model may ramble until the context is full, or
        # call tools until the history no longer fits: Codex then ends the turn by saying so,
        # having understood every answer. Any other failure is the protocol's.
        endings = [line for line in output.splitlines() if line.startswith("ERROR: ")]
        assert endings and all(_MODEL_ENDING.search(line) for line in endings), (
            f"codex failed; it sent {sent}:\n{output[-4000:]}"
        )
    assert "invalid_request_error" not in output, output[-4000:]
    bodies = [body for method, path, body in proxy.requests if path == "/v1/responses"]
    assert bodies, f"codex sent no Responses request: {sent}"
    first = bodies[0]
    assert first["stream"] is True and first["store"] is False
    assert {tool["type"] for tool in first["tools"]} >= {"function", "namespace"}
