"""Servers started by the bench listen on 127.0.0.1 and are always stopped, also on error, and
so are the processes they start (vLLM runs its engine in a child process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from slotserve.bench import servers
from slotserve.bench.servers import ServerSpec, free_port, running, slotserve_spec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as stopped.
    return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def test_server_is_stopped_when_the_run_fails(model_path: Path, tmp_path: Path) -> None:
    spec = slotserve_spec(model_path, slots=1, threads=1, ctx_per_slot=512)
    assert "127.0.0.1" in spec.command
    pid = None
    with pytest.raises(RuntimeError, match="benchmark blew up"), running(spec, tmp_path) as srv:
        pid = srv.pid
        assert httpx.get(spec.base_url + "/health").status_code == 200
        raise RuntimeError("benchmark blew up")
    assert pid is not None and not _alive(pid)


def test_a_server_that_dies_at_start_is_reported(tmp_path: Path) -> None:
    spec = ServerSpec("broken", [sys.executable, "-c", "raise SystemExit(3)"], free_port())
    with pytest.raises(RuntimeError, match="exited with 3"), running(spec, tmp_path):
        pass


# A server that starts a child which ignores SIGTERM, records that child's pid and one variable
# of its environment, then serves /v1/models.
_PARENT = """
import http.server, os, subprocess, sys
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
Path(sys.argv[2]).write_text(f"{child.pid} {os.environ.get('BENCH_PEER_SETTING')}")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler
                       ).serve_forever()
"""


def test_children_that_outlive_the_server_are_stopped_and_env_is_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "CHILD_GRACE_S", 1.0)
    port, record = free_port(), tmp_path / "child"
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")  # what the readiness probe fetches
    spec = ServerSpec(
        "parent",
        [sys.executable, "-c", _PARENT, str(port), str(record)],
        port,
        env={"BENCH_PEER_SETTING": "on"},
    )
    monkeypatch.chdir(tmp_path)  # SimpleHTTPRequestHandler serves the working directory
    with running(spec, tmp_path / "logs", timeout_s=60):
        child_pid, setting = record.read_text().split()
    assert setting == "on"
    assert not _alive(int(child_pid))
