"""Claude Code (the ``claude`` CLI from npm, in ``.clients/``) completing one ``-p`` turn
against a spawned server on the embedded model, through a recording proxy so the test sees
what the CLI sent and what it was answered.

Claude Code's default prompt (its system prompt and built-in tools) is about 12,000 tokens,
more than the embedded model's 8,192-token context, and asks for ``max_tokens`` 32,000: the
default turn runs with ``--tools ""`` and a short ``--system-prompt``, so it fits one slot of
8,192 tokens; ``SLOTSERVE_CLAUDE_FULL_PROMPT=1`` runs the default prompt on a 65,536-token
slot instead (the context past the trained length degrades the answer, not the protocol, and
its prefill takes minutes on a few CPU cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.recording_proxy import RecordingProxy
from tests.conftest import ServerProcess, start_server, stop_server

pytestmark = pytest.mark.clients

CLAUDE = Path(__file__).resolve().parents[2] / ".clients" / "node_modules" / ".bin" / "claude"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY = "claude-code-key"
FULL = os.environ.get("SLOTSERVE_CLAUDE_FULL_PROMPT") == "1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    if not CLAUDE.exists():
        pytest.skip(f"Claude Code is not installed ({CLAUDE}); `make clients` installs it")
    ctx = "65536" if FULL else "8192"
    tmp = tmp_path_factory.mktemp("claude-code")
    proc = start_server(tmp, "--slots", "1", "--ctx-size", ctx, "--api-key", KEY)
    yield proc
    stop_server(proc)


def _summary(path: str, body: Any) -> dict[str, Any]:
    body = body if isinstance(body, dict) else {}
    blocks = [
        b.get("type")
        for m in body.get("messages", [])
        for b in (m["content"] if isinstance(m["content"], list) else [{"type": "str"}])
    ]
    return {
        "path": path,
        "fields": sorted(body),
        "max_tokens": body.get("max_tokens"),
        "thinking": body.get("thinking"),
        "roles": [m["role"] for m in body.get("messages", [])],
        "blocks": blocks,
        "tools": len(body.get("tools", [])),
    }


def test_claude_code_completes_a_turn(server: ServerProcess, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    command = [str(CLAUDE), "-p", "say hi"]
    if not FULL:
        command += ["--tools", "", "--system-prompt", "You are a helpful assistant."]
    with RecordingProxy(server.base_url) as proxy:
        env = {
            **os.environ,
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_API_KEY": KEY,
            "ANTHROPIC_AUTH_TOKEN": KEY,
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        done = subprocess.run(
            command,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600 if FULL else 300,
        )
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    transcript = {
        "command": command,
        "exit_code": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr[-2000:],
        "requests": [_summary(path, body) for _, path, body in proxy.requests],
        "errors": [
            line for line in metrics.splitlines() if line.startswith("slotserve:http_errors_total")
        ],
    }
    print(json.dumps(transcript, indent=1))  # the record docs/clients.md quotes
    assert done.returncode == 0, transcript
    assert done.stdout.strip() and "API Error" not in done.stdout, transcript
    assert any(path.startswith("/v1/messages") for _, path, _ in proxy.requests), transcript
    # Every turn ended: the server log names each finished request.
    assert "finished:" in server.log_path.read_text(), transcript
