"""Schemathesis against the server's own OpenAPI schema, with all four of its phases: the
schema's examples, coverage (boundary and invalid values of every field, unexpected methods),
fuzzing (generated requests, valid and not) and stateful (chains that follow the schema's links:
a model id from the model list, a response id, token ids). Every route is tested; no request may
get a 5xx or run past its timeout. Bounded for CI (a small context per slot, a short request
timeout, ``SLOTSERVE_FUZZ_CASES`` generated cases per route in the fuzzing and stateful phases,
10 unless set); ``make fuzz`` runs a larger round. The counts per phase are printed and written
to ``fuzz.json`` in the test's directory."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

CASES = int(os.environ.get("SLOTSERVE_FUZZ_CASES", "10"))
PHASES = ("examples", "coverage", "fuzzing", "stateful")
REQUEST_TIMEOUT_S = 60  # the client's bound on one request: one past it is a hang
# Reloading on purpose ends in-flight requests; it has its own tests.
EXCLUDED = ("POST /admin/reload",)
MIN_CASES = 2000


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("fuzz"),
        "--slots",
        "4",
        "--threads",
        "1",  # schemathesis needs a core too: llama.cpp's threads crawl when they share one
        "--ctx-size",
        str(4 * 128),
        # A positive case often leaves max_tokens out: it then generates to the context's end.
        "--request-timeout",
        "5",
    )
    yield proc
    stop_server(proc)


def _run_schemathesis(base_url: str, out: Path) -> tuple[int, str, list[dict[str, Any]]]:
    """Runs the schemathesis CLI (its own process, as a user would); returns its exit code,
    its output and its NDJSON event stream."""
    events_path = out / "events.ndjson"
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--phases",
        ",".join(PHASES),
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(CASES),
        "--workers",
        "1",  # the server needs the machine's other core
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--seed",
        os.environ.get("SLOTSERVE_FUZZ_SEED", "20261124"),
        "--suppress-health-check",
        "all",
        "--generation-database",
        "none",
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(events_path),
        "--no-color",
        *(f"--exclude-path={label.split()[1]}" for label in EXCLUDED),
    ]
    done = subprocess.run(
        command, cwd=out, capture_output=True, text=True, timeout=3600, check=False
    )
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    return done.returncode, done.stdout + done.stderr, events


def _tally(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Cases and response statuses per phase, the routes tested, and every 5xx and request
    that got no response (a timeout, a dropped connection)."""
    cases: collections.Counter[str] = collections.Counter()
    statuses: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    phase_status: dict[str, str] = {}
    routes: set[str] = set()
    server_errors: list[str] = []
    no_response: list[str] = []
    links: collections.Counter[str] = collections.Counter()  # transition → steps that took it
    for event in events:
        if "PhaseFinished" in event:
            finished = event["PhaseFinished"]
            phase_status[finished["phase"]["name"]] = finished["status"]
        if "ScenarioFinished" not in event:
            continue
        scenario = event["ScenarioFinished"]
        phase, recorder = scenario["phase"], scenario.get("recorder") or {}
        cases[phase] += len(recorder.get("cases", {}))
        for case in recorder.get("cases", {}).values():
            routes.add(f"{case['value']['method']} {case['value']['path']}")
            if case.get("is_transition_applied"):
                links[case["transition"]["id"]] += 1
        for interaction in recorder.get("interactions", {}).values():
            request, response = interaction["request"], interaction.get("response")
            what = f"{phase}: {request['method']} {request['uri']}"
            if response is None:
                no_response.append(what)
                continue
            statuses[phase][response["status_code"]] += 1
            if response["status_code"] >= 500:
                server_errors.append(f"{what} → {response['status_code']}")
    return {
        "cases": dict(cases),
        "total_cases": sum(cases.values()),
        "phases": phase_status,
        "statuses": {p: dict(sorted(c.items())) for p, c in statuses.items()},
        "routes": sorted(routes),
        "links_followed": dict(links),
        "server_errors": server_errors,
        "no_response": no_response,
    }


def test_every_phase_over_every_route_gets_no_server_error(
    fuzz_server: ServerProcess, tmp_path: Path
) -> None:
    code, output, events = _run_schemathesis(fuzz_server.base_url, tmp_path)
    tally = _tally(events)
    summary = {k: v for k, v in tally.items() if k != "routes"} | {"max_examples": CASES}
    (tmp_path / "fuzz.json").write_text(json.dumps(summary, indent=2))
    print("\nfuzz:", json.dumps(summary))  # the figures for the closing note

    assert tally["server_errors"] == [], tally["server_errors"][:10]
    assert tally["no_response"] == [], tally["no_response"][:10]
    assert code == 0, output[-4000:]
    for phase in PHASES:
        assert tally["phases"].get(phase) == "success", (phase, tally["phases"])
        assert tally["cases"].get(phase, 0) > 0, (phase, tally["cases"])
    assert tally["total_cases"] >= MIN_CASES, tally["cases"]
    # Every route of the schema was called, but the ones left out on purpose.
    schema = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json()
    documented = {f"{m.upper()} {p}" for p, ops in schema["paths"].items() for m in ops}
    assert documented - set(EXCLUDED) <= set(tally["routes"]), documented - set(tally["routes"])
    # The stateful phase followed the links: requests built from an earlier response.
    assert len(tally["links_followed"]) >= 5, tally["links_followed"]


def test_the_fuzzed_server_is_still_healthy(fuzz_server: ServerProcess) -> None:
    # Runs after the fuzzing above (tests run in file order).
    assert wait_until(lambda: fuzz_server.slots()["num_running"] == 0, timeout=60)
    stats = fuzz_server.slots()
    assert stats["state"] == "ready" and stats["requests_failed"] == 0
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=10).json() == {"status": "ok"}
