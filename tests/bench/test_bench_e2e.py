"""`slotserve bench` against a real spawned server, 2 concurrent clients. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slotserve.bench.datasets import Conversation
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark
from tests.bench.test_bench_logic import VLLM_HEADER_KEYS, VLLM_KEYS
from tests.conftest import ServerProcess


def _bench(server: ServerProcess, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "bench",
            "--base-url",
            server.base_url,
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--max-tokens",
            "12",
            "--input-len",
            "8",
            "--warmup",
            "1",
            "--no-progress",
            "--output-json",
            str(out),
            "--server-pid",
            str(server.process.pid),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_run_writes_a_complete_report(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = _bench(server, out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert set(report) >= VLLM_KEYS | VLLM_HEADER_KEYS  # flat, as vLLM writes its results
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 12  # from the server's usage, ignore_eos
    assert report["max_concurrency"] == 2 and report["model_id"]
    assert report["isolation_failures"] == []
    assert report["server_memory"]["rss_before_bytes"] > 0
    assert "output throughput" in result.stdout


def test_missed_target_exits_non_zero(server: ServerProcess, tmp_path: Path) -> None:
    result = _bench(server, tmp_path / "run.json", "--expect-min-output-tps", "1e9")
    assert result.returncode == 1
    assert "target missed" in result.stderr


def test_multi_turn_chat_and_completions_endpoint(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "turns.json"
    result = _bench(server, out, "--dataset", "multi-turn", "--turns", "2")
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["completed"] == 8  # 4 chats × 2 turns
    result = _bench(
        server, out, "--endpoint", "completions", "--dataset", "shared-prefix", "--prefix-len", "50"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["completed"] == 4


def test_poisson_arrivals_for_a_duration(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "poisson.json"
    result = _bench(server, out, "--duration", "2", "--request-rate", "4")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["config"]["request_rate"] == 4.0 and report["config"]["duration_s"] == 2.0
    assert report["completed"] >= 1 and report["failed"] == 0


def test_agent_workload_reports_ttft_by_turn_apart_from_the_background(
    server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "agent.json"
    result = _bench(
        server,
        out,
        "--dataset",
        "agent",
        "--agent-prefix-len",
        "200",
        "--agent-conversations",
        "2",
        "--agent-turns",
        "2",
        "--agent-background",
        "1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert set(report) >= VLLM_KEYS | VLLM_HEADER_KEYS
    assert report["completed"] == 4 and report["failed"] == 0  # 2 conversations × 2 turns
    assert report["completed_turn1"] == 2 and report["completed_turn2plus"] == 2
    for key in ("p50_ttft_turn1_ms", "p90_ttft_turn1_ms", "p50_ttft_turn2plus_ms"):
        assert report[key] > 0
    first, second = report["turns"]
    assert first["turn"] == 1 and second["turn"] == 2
    # Turn 2 resends turn 1 with its reply: each conversation's prompt grows.
    pairs = zip(first["prompt_tokens"], second["prompt_tokens"], strict=True)
    assert all(later > earlier > 200 for earlier, later in pairs)
    # The background ran beside the agent and is counted apart from it.
    background = report["background"]
    assert background["streams"] == 1 and background["completed"] >= 1
    assert background["failed"] == 0
    assert report["total_output_tokens"] == 4 * 12
    assert report["isolation_failures"] == []
    assert "TTFT by turn" in result.stdout


def test_identical_replies_that_each_prompt_gives_alone_are_not_an_isolation_failure(
    server: ServerProcess,
) -> None:
    # Two conversations asking the same: the greedy replies are identical by right, which the
    # check can only tell from cross-talk by sending each again alone.
    question = "Name three rivers in Europe and say one thing about each."
    conversations = [Conversation(name, [question], 16) for name in ("first", "second")]
    config = LoadConfig(base_url=server.api_url, concurrency=2)
    report = run_benchmark(config, conversations, show_progress=False)
    assert report["completed"] == 2 and report["isolation_failures"] == []
    assert report["isolation_reproduced_alone"][0]["prompt_ids"] == ["first/0", "second/0"]
    unchecked = run_benchmark(config, conversations, show_progress=False, recheck_isolation=False)
    assert len(unchecked["isolation_failures"]) == 1
