"""Servers started by the bench listen on 127.0.0.1 and are always stopped, also on error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

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
