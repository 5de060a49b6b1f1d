"""Soak test (marked ``soak``, run by ``make soak``, not by ``make test``): the mixed load of
``load.py`` against a real spawned server on each runner (llama.cpp and PyTorch), at
concurrency 16, with the engine process killed (SIGKILL) twice, at a third and two thirds of the
requests; the server restarts it by itself.

A kill window runs from the kill until ``/ready`` answers again with a new engine. A request
that overlaps one may end with a 503 (a refusal while the engine restarts, with Retry-After) or
an error (a request the dead engine had taken); outside them no request may get a 5xx. Anywhere, a
request that outlives its deadline (a hang), a dropped connection or a wrong answer fails the
test. Afterwards the server must hold nothing: no busy slot, no queued request, KV usage back to
idle, a clean KV integrity check (it checks every KV block's holders); two restarts counted in
``/metrics``; each killed engine reaped, and once the server is stopped none of its processes
left. ``SLOTSERVE_SOAK_REQUESTS`` and ``SLOTSERVE_SOAK_CONCURRENCY`` change the size; the
figures are printed and written to ``soak-RUNNER.json`` in the test's directory."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server, stop_server, wait_until
from tests.soak.load import Load, Outcome, run_load

pytestmark = pytest.mark.soak

SLOTS = 16
# The runner's own flags; each gets SLOTS slots of 512 positions.
RUNNERS: dict[str, tuple[str, ...]] = {
    "llama.cpp": ("--ctx-size", str(SLOTS * 512)),
    "torch": ("--runner", "torch", "--max-model-len", "512"),
}
REQUESTS = int(os.environ.get("SLOTSERVE_SOAK_REQUESTS", "1000"))
CONCURRENCY = int(os.environ.get("SLOTSERVE_SOAK_CONCURRENCY", "16"))
DEADLINE_S = 120.0  # per request: generations are short, a restart takes seconds
KILLS = 2
RESTART_BOUND_S = 60.0  # from a kill until /ready answers with a new engine
# How a request may end: anywhere, and also inside a kill window.
FINE = {"completed", "malformed"}
FINE_IN_A_WINDOW = {"server error", "stream error"}


@dataclass
class Kill:
    pid: int  # the engine process killed
    start: str | None  # its start time (/proc), to tell it from a later process with its PID
    at: float  # monotonic seconds
    ready_at: float | None = None  # /ready answered again, with a new engine

    @property
    def window(self) -> tuple[float, float]:
        return self.at, self.ready_at if self.ready_at is not None else float("inf")


@pytest.fixture(params=list(RUNNERS))
def soak_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path,
        "--slots",
        str(SLOTS),
        "--max-queue",
        "512",
        "--threads",
        "1",  # the clients need the other core: a runner's threads crawl when they share one
        "--log-level",
        "warning",
        *RUNNERS[request.param],
    )
    yield proc
    stop_server(proc)  # again, if the test did not get that far


async def _kill_twice(base_url: str, load: Load, kills: list[Kill]) -> None:
    """Beside the load: kills the engine at each mark, then waits until it is back."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:

        async def engine_pid() -> int:
            return int((await http.get("/v1/slots")).json()["engine_pid"])

        for k in range(1, KILLS + 1):
            while load.sent < load.requests * k // (KILLS + 1):
                await asyncio.sleep(0.05)  # polling the load's progress
            pid = await engine_pid()
            kill = Kill(pid, _start_time(pid), time.monotonic())
            os.kill(kill.pid, signal.SIGKILL)
            kills.append(kill)
            while time.monotonic() - kill.at < RESTART_BOUND_S:
                if (await http.get("/ready")).status_code == 200 and (
                    await engine_pid() != kill.pid
                ):
                    kill.ready_at = time.monotonic()
                    break
                await asyncio.sleep(0.05)  # polling for the restart
            else:
                return  # not back in time: the test fails on ready_at


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def _descendants(pid: int) -> dict[int, str]:
    """``pid``'s processes, children and theirs (Linux /proc), each with its start time, so a
    reused PID is not taken for one of them."""
    parents: dict[int, int] = {}
    starts: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)], starts[int(entry)] = int(fields[1]), fields[19]
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = starts[child]
                frontier.append(child)
    return found


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _running(pid: int, start: str | None) -> bool:
    """The process that started at ``start`` still exists, zombies included (a killed child
    nobody reaped is left behind too)."""
    return start is not None and _start_time(pid) == start


def _in_a_window(outcome: Outcome, kills: list[Kill]) -> bool:
    return any(outcome.overlaps(*kill.window) for kill in kills)


def _error_kind(outcome: Outcome, kills: list[Kill]) -> str:
    """A window's error as ``status code``, then whether the request was in flight at the
    kill or came after it, and whether it was told when to come back."""
    if outcome.kind not in FINE_IN_A_WINDOW:
        return "no error"
    kill = next(k for k in kills if outcome.overlaps(*k.window))
    when = "in flight" if outcome.started < kill.at else "after the kill"
    retry = ", Retry-After" if outcome.retry_after is not None else ""
    return f"{outcome.status} {outcome.code} ({when}{retry})"


def test_soak_with_engine_kills(soak_server: ServerProcess, tmp_path: Path) -> None:
    base = soak_server.base_url
    runner = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["runner"]
    load = Load(REQUESTS, CONCURRENCY, DEADLINE_S)
    kills: list[Kill] = []

    async def soak() -> None:
        await asyncio.gather(run_load(base, load), _kill_twice(base, load, kills))

    started = time.monotonic()
    asyncio.run(soak())
    duration = time.monotonic() - started

    # Every disconnect frees its slot within a step; give the last ones a moment to land.
    def idle() -> bool:
        slots = soak_server.slots()
        return slots["num_waiting"] == 0 and all(s["state"] == "free" for s in slots["slots"])

    assert wait_until(idle, timeout=60), soak_server.slots()
    checks_at_idle = httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_checks"]
    stats = soak_server.slots()
    cache = httpx.get(f"{base}/v1/prefix_cache_stats").json()
    inside = [o for o in load.outcomes if _in_a_window(o, kills)]
    outside = [o for o in load.outcomes if not _in_a_window(o, kills)]
    kinds = collections.Counter(o.kind for o in load.outcomes)
    summary: dict[str, Any] = {
        "runner": runner,
        "requests": load.sent,
        "concurrency": CONCURRENCY,
        "outcomes": dict(sorted(kinds.items())),
        "in_kill_windows": {
            "requests": len(inside),
            "outcomes": dict(collections.Counter(o.kind for o in inside)),
            "errors": dict(collections.Counter(_error_kind(o, kills) for o in inside)),
        },
        "server_errors_5xx_outside_windows": sum(1 for o in outside if o.kind == "server error"),
        "restart_s": [
            round(k.ready_at - k.at, 2) if k.ready_at is not None else None for k in kills
        ],
        "engine_restarts_total": _metric(base, "slotserve:engine_restarts_total"),
        "last_engine": {
            key: stats[key]
            for key in (
                "requests_submitted",
                "requests_finished",
                "requests_aborted",
                "requests_failed",
            )
        },
        "busy_slots_after": sum(1 for s in stats["slots"] if s["state"] != "free"),
        "kv_used_tokens_after": stats["kv_used_tokens"],
        "kv_cache_usage_after": _metric(base, "vllm:kv_cache_usage_perc"),
        "integrity_checks": cache["integrity_checks"],
        "integrity_failures": cache["integrity_failures"],
        "prefix_cache_hit_rate": cache["hit_rate"],
        "duration_s": round(duration, 1),
    }
    samples = {_error_kind(o, kills): o.detail for o in inside if o.kind in FINE_IN_A_WINDOW}
    (tmp_path / f"soak-{runner}.json").write_text(
        json.dumps({**summary, "error_samples": samples}, indent=2)
    )
    print(f"\nsoak ({runner}):", json.dumps(summary))  # the figures for RESULTS.md

    assert load.sent >= REQUESTS
    assert len(kills) == KILLS and all(k.ready_at is not None for k in kills), kills
    hangs = [o.detail for o in load.outcomes if o.kind == "hang"]
    assert hangs == [], hangs[:5]
    wrong = [o for o in load.outcomes if o.kind in {"bad", "transport error"}]
    assert wrong == [], wrong[:5]
    unexpected = [o for o in outside if o.kind not in FINE and not o.kind.startswith("disconnect")]
    assert unexpected == [], unexpected[:5]  # no 5xx nor error event outside the windows
    # In a window: a refusal says when to come back; any other error is that of a request the
    # dead engine had taken.
    for outcome in inside:
        if outcome.kind == "server error":
            assert outcome.status == 503, outcome
        if outcome.kind in FINE_IN_A_WINDOW and outcome.retry_after is None:
            assert "failed while serving this request" in outcome.detail, outcome
    assert any(o.retry_after is not None for o in inside), "no refusal while restarting"
    # The last engine's books: everything it took finished or was cleanly aborted.
    assert stats["requests_failed"] == 0
    assert stats["requests_submitted"] == stats["requests_finished"] + stats["requests_aborted"]
    assert stats["requests_aborted"] > 0, "the disconnects reached the engine"
    assert summary["busy_slots_after"] == 0 and stats["kv_used_tokens"] == 0
    assert summary["kv_cache_usage_after"] == 0.0
    assert _metric(base, "vllm:num_requests_running") == 0
    assert cache["integrity_failures"] == 0 and checks_at_idle > 0
    assert summary["engine_restarts_total"] == KILLS
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    after = httpx.post(f"{base}/v1/completions", json={"prompt": "Still there?", "max_tokens": 3})
    assert after.status_code == 200
    # The idle-time integrity check ran again after this request, and was clean.
    assert wait_until(
        lambda: (
            httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_checks"] > checks_at_idle
        )
    )
    assert httpx.get(f"{base}/v1/prefix_cache_stats").json()["integrity_failures"] == 0

    # No process left behind: the killed engines were reaped, and nothing outlives the server.
    assert wait_until(lambda: not any(_running(k.pid, k.start) for k in kills), timeout=10), kills
    processes = _descendants(soak_server.process.pid)
    assert processes, "the server has no engine process"
    stop_server(soak_server)
    assert soak_server.process.returncode == 0, soak_server.log_path.read_text()[-3000:]
    assert wait_until(lambda: not any(_running(p, s) for p, s in processes.items()), timeout=20), {
        p: s for p, s in processes.items() if _running(p, s)
    }
