"""``slotserve bench speculative`` end to end: two real servers (drafts on, off) on the embedded
model, the edit workload at one stream; the report pairs them and reads the server's
spec-decode counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slotserve.cli import main

pytestmark = pytest.mark.slow  # two real servers, started by the bench itself


def test_bench_speculative_pairs_on_and_off(tmp_path: Path) -> None:
    out = tmp_path / "spec"
    code = main(
        [
            "bench", "speculative", "--runners", "llama.cpp", "--workloads", "edit",
            "--concurrency", "1", "--requests-per-client", "2", "--min-requests", "2",
            "--max-tokens", "48",
            "--threads", "2", "--output-dir", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "speculative.json").read_text())
    (cell,) = result["cells"]
    assert (cell["runner"], cell["workload"], cell["concurrency"]) == ("llama.cpp", "edit", 1)
    assert cell["on_output_tps"] > 0 and cell["off_output_tps"] > 0
    assert cell["output_ratio"] == cell["on_output_tps"] / cell["off_output_tps"]
    # The passages are copied, so the server drafted and most drafts were accepted.
    assert cell["draft_tokens"] > 0 and cell["acceptance"] > 0.5, cell
    runs = result["runs"]
    assert {r["speculation"] for r in runs} == {True, False}
    assert all(r["spec_decode"]["num_draft_tokens"] == 0 for r in runs if not r["speculation"])
    assert "| llama.cpp | edit | 1 |" in (out / "speculative.md").read_text()
