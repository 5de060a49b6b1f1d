"""Bench logic without a server: percentiles, arrivals, datasets, report schema (flat, vLLM's
keys), targets, and the vLLM peers' command lines."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from slotserve.bench.datasets import (
    agent_dataset,
    agent_prefix,
    approx_tokens,
    background_dataset,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from slotserve.bench.loadgen import LoadConfig, poisson_gaps
from slotserve.bench.metrics import (
    RequestResult,
    describe_isolation,
    isolation_failures,
    percentile,
    reproduced_alone,
    summarize,
    turn_summary,
)
from slotserve.bench.passages import PASSAGES
from slotserve.bench.report import Targets
from slotserve.bench.runner import build_dataset, vllm_header, write_run_json
from slotserve.bench.vllm_peer import VllmPeer, prepare_vllm, vllm_env, vllm_spec

VLLM_KEYS = {
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "p95_ttft_ms",
    "p50_itl_ms",
}
# What `vllm bench serve --save-result` writes before its metrics (vllm/benchmarks/serve.py).
VLLM_HEADER_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "request_goodput",
}


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(7.6)  # numpy.percentile gives 7.6
    assert percentile([], 99) == 0.0


def test_poisson_gaps_have_the_asked_mean_rate() -> None:
    gaps = list(itertools.islice(poisson_gaps(4.0, seed=1), 20_000))
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: the spread equals the mean (fixed 1/rate gaps would have none).
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)
    assert list(itertools.islice(poisson_gaps(float("inf"), 0), 3)) == [0.0, 0.0, 0.0]
    assert list(itertools.islice(poisson_gaps(2.0, 7), 5)) == list(
        itertools.islice(poisson_gaps(2.0, 7), 5)
    )
    assert list(itertools.islice(poisson_gaps(2.0, 7), 5)) != list(
        itertools.islice(poisson_gaps(2.0, 8), 5)
    ), "the seed matters"


def test_random_dataset_is_distinct_seeded_and_sized() -> None:
    data = random_dataset(50, input_len=20, output_len=64, range_ratio=0.5, seed=3)
    prompts = [c.user_turns[0] for c in data]
    assert len(set(prompts)) == 50
    assert all(32 <= c.max_tokens <= 96 for c in data)
    assert all(10 <= len(p.split()) - 5 <= 30 for p in prompts)  # 5 words of instruction
    again = random_dataset(50, input_len=20, output_len=64, range_ratio=0.5, seed=3)
    assert [c.user_turns for c in again] == [c.user_turns for c in data]
    assert random_dataset(5, 20, 64, seed=9)[0].user_turns != data[0].user_turns


def test_edit_dataset_asks_to_copy_or_edit_a_given_passage() -> None:
    data = build_dataset("edit", 2 * len(PASSAGES), 0, 96)
    prompts = [c.user_turns[0] for c in data]
    assert len(set(prompts)) == len(prompts) and all(c.max_tokens == 96 for c in data)
    for index, (passage, word, replacement) in enumerate(PASSAGES):
        assert word in passage
        copy, edit = prompts[index], prompts[index + len(PASSAGES)]
        assert copy.endswith(passage) and "exactly" in copy
        assert edit.endswith(passage) and repr(word) in edit and repr(replacement) in edit
    assert build_dataset("edit", 3, 0, 96, seed=1)[0].user_turns == data[1].user_turns
    opened = build_dataset("open", 20, 0, 64)
    assert len({c.user_turns[0] for c in opened}) == 16  # the topics, in turn


def test_shared_prefix_dataset_shares_one_system_prompt() -> None:
    data = shared_prefix_dataset(16, prefix_len=300, input_len=10, output_len=32)
    systems = {c.system for c in data}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 300  # type: ignore[union-attr]
    assert len({c.user_turns[0] for c in data}) == 16
    messages = data[0].messages(0)
    assert [m["role"] for m in messages] == ["system", "user"]


def test_multi_turn_conversation_resends_history_with_replies() -> None:
    conv = multi_turn_dataset(1, turns=3, input_len=5, output_len=8)[0]
    conv.replies += ["first reply", "second reply"]
    roles = [m["role"] for m in conv.messages(2)]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert conv.messages(2)[1]["content"] == "first reply"
    assert conv.prompt(1).splitlines()[1] == "first reply"


def test_agent_conversations_share_one_prefix_and_grow_their_own_history() -> None:
    data = agent_dataset(3, turns=4, prefix_len=500, input_len=6, output_len=16, seed=5)
    assert len(data) == 3 and all(len(c.user_turns) == 4 for c in data)
    assert all(c.max_tokens == 16 for c in data)
    prefix = data[0].system
    assert prefix is not None and all(c.system == prefix for c in data)
    assert prefix == agent_prefix(500, seed=5) and 500 <= approx_tokens(prefix) < 800
    assert prefix != agent_prefix(500, seed=6), "the seed matters"
    assert '"name": "read_file"' in prefix and '"parameters": {' in prefix  # tool schemas
    user_turns = [turn for c in data for turn in c.user_turns]
    assert len(set(user_turns)) == 3 * 4
    assert data[1].user_turns[2].startswith("Conversation 1, turn 3.")
    assert agent_dataset(3, 4, 500, 6, 16, seed=5)[2].user_turns == data[2].user_turns
    # A longer prefix changes only the prefix, not the conversations' own turns.
    longer = agent_dataset(3, 4, 2000, 6, 16, seed=5)
    assert approx_tokens(longer[0].system or "") >= 2000
    assert [c.user_turns for c in longer] == [c.user_turns for c in data]

    conv = data[0]
    conv.replies += ["reply one", "reply two"]
    earlier = conv.messages(1)
    later = conv.messages(2)
    assert later[0] == {"role": "system", "content": prefix}
    assert later[: len(earlier)] == earlier  # each turn extends the previous one's prompt
    assert [m["role"] for m in later] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert conv.prompt(2).startswith(prefix + "\n") and conv.prompt(2).startswith(conv.prompt(1))


def test_background_prompts_are_distinct_from_each_other_and_the_agent() -> None:
    background = background_dataset(8, input_len=6, output_len=16)
    assert len({c.user_turns[0] for c in background}) == 8
    assert all(c.system is None and c.max_tokens == 16 for c in background)
    assert {c.conversation_id for c in background} == {f"background-{i}" for i in range(8)}
    agent = build_dataset("agent", 2, 6, 16, agent_prefix_len=100, agent_turns=2)
    agent_turns = {turn for c in agent for turn in c.user_turns}
    assert agent_turns.isdisjoint(c.user_turns[0] for c in background)


def test_turn_summary_splits_first_turns_from_later_ones() -> None:
    def turn(pid: str, index: int, ttft: float, prompt_tokens: int) -> RequestResult:
        return RequestResult(pid, success=True, turn=index, ttft=ttft, prompt_tokens=prompt_tokens)

    results = [
        turn("a/0", 0, 1.0, 100),
        turn("b/0", 0, 3.0, 100),
        turn("a/1", 1, 0.2, 130),
        turn("b/1", 1, 0.4, 140),
        turn("a/2", 2, 0.6, 170),
        RequestResult("b/2", turn=2, error="HTTP 500"),
    ]
    summary = turn_summary(results)
    assert summary["completed_turn1"] == 2 and summary["completed_turn2plus"] == 3
    assert summary["p50_ttft_turn1_ms"] == pytest.approx(2000.0)
    assert summary["p90_ttft_turn1_ms"] == pytest.approx(2800.0)
    assert summary["p50_ttft_turn2plus_ms"] == pytest.approx(400.0)
    assert [t["turn"] for t in summary["turns"]] == [1, 2, 3]
    assert summary["turns"][1]["prompt_tokens"] == [130, 140]
    assert summary["turns"][1]["mean_prompt_tokens"] == pytest.approx(135.0)
    assert summary["turns"][2]["completed"] == 1
    json.dumps(summary)
    # No later turn answered: no figure, rather than a 0 that reads as instant.
    only_first = turn_summary(results[:2])
    assert only_first["p50_ttft_turn2plus_ms"] is None and only_first["completed_turn2plus"] == 0


def test_sharegpt_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "Hello there"},
                        {"from": "gpt", "value": "Hi"},
                    ]
                },
                {"conversations": [{"from": "gpt", "value": "no human turn"}]},
                {"conversations": [{"from": "human", "value": "Second question"}]},
            ]
        )
    )
    data = sharegpt_dataset(path, num=4, max_tokens=50)
    assert len(data) == 4
    assert {c.user_turns[0] for c in data} == {"Hello there", "Second question"}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError):
        sharegpt_dataset(bad, 1, 10)


def _result(pid: str, text: str, ok: bool = True, temperature: float = 0.0) -> RequestResult:
    return RequestResult(
        pid,
        success=ok,
        start=0.0,
        ttft=0.1,
        latency=1.1,
        itl=[0.05, 0.15],
        prompt_tokens=10,
        output_tokens=11,
        text=text,
        temperature=temperature,
    )


def test_summary_uses_vllm_key_names_and_counts_failures() -> None:
    results = [_result("a", "x" * 20), _result("b", "y" * 20), _result("c", "", ok=False)]
    summary = summarize(results, duration=2.0)
    assert set(summary) >= VLLM_KEYS
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == pytest.approx(11.0)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10 tokens
    assert summary["p99_itl_ms"] == pytest.approx(150.0)
    assert summary["median_itl_ms"] == pytest.approx(100.0)
    json.dumps(summary)


def test_isolation_check_flags_identical_greedy_outputs_of_distinct_prompts() -> None:
    same = "the same answer, long enough"
    results = [
        _result("p1", same),
        _result("p2", same),
        _result("p3", "different " * 3),
        _result("p4", same, temperature=0.7),
    ]
    failures = isolation_failures(results)
    assert [describe_isolation(group) for group in failures] == [
        {"prompt_ids": ["p1", "p2"], "text": same}
    ]
    # Sent again one at a time: the same text from each is the model's own answer.
    alone = {"p1": _result("p1", same), "p2": _result("p2", same)}
    assert reproduced_alone(failures[0], alone)
    assert not reproduced_alone(failures[0], {**alone, "p2": _result("p2", "its own answer")})
    assert not reproduced_alone(failures[0], {"p1": alone["p1"]}), "p2 was not sent again"
    assert isolation_failures([_result("p1", same), _result("p1", same)]) == []
    # Two turns of one conversation may repeat themselves; two conversations may not.
    assert isolation_failures([_result("c1/0", same), _result("c1/1", same)]) == []
    assert len(isolation_failures([_result("c1/0", same), _result("c2/0", same)])) == 1
    # A duration run resends the dataset: the repeat of c1 is the same prompt.
    assert isolation_failures([_result("c1/0", same), _result("c1#1/0", same)]) == []
    # A degenerate loop of a few words is a small model's stock reply, not a leak.
    loop = " to the way of" * 32
    assert isolation_failures([_result("p1", loop), _result("p2", loop)]) == []


def test_targets_report_every_miss(tmp_path: Path) -> None:
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"output_throughput": 100.0}))  # flat, as vLLM writes it
    report: dict[str, Any] = {
        **summarize([_result("a", "x" * 20)], 1.0),
        "isolation_failures": [],
    }
    assert Targets().missed(report) == []
    misses = Targets(
        min_output_tps=50, speedup_baseline=baseline, min_speedup=1.0, max_failed=0
    ).missed(report)
    assert len(misses) == 2 and report["speedup_vs_baseline"] == pytest.approx(0.11)
    report["isolation_failures"] = [{"prompt_ids": ["a", "b"], "text": "t"}]
    assert any("isolation" in m for m in Targets().missed(report))


def test_targets_read_a_baseline_from_before_the_flat_schema(tmp_path: Path) -> None:
    baseline = tmp_path / "old.json"
    baseline.write_text(json.dumps({"summary": {"output_throughput": 5.5}}))
    report: dict[str, Any] = {**summarize([_result("a", "x" * 20)], 1.0), "isolation_failures": []}
    assert Targets(speedup_baseline=baseline).missed(report) == []
    assert report["speedup_vs_baseline"] == pytest.approx(2.0)


def test_run_json_is_flat_with_vllm_keys(tmp_path: Path) -> None:
    config = LoadConfig("http://127.0.0.1:1/v1", model="m", endpoint="completions", concurrency=16)
    report = {
        **vllm_header(config, "random ×16", 32),
        **summarize([_result("a", "x" * 20), _result("b", "y" * 20)], 2.0),
        "isolation_failures": [],
        "samples": {"ttft_ms": [100.0], "itl_ms": []},
    }
    path = tmp_path / "runs" / "run.json"
    write_run_json(report, path)
    saved = json.loads(path.read_text())
    assert set(saved) >= VLLM_KEYS | VLLM_HEADER_KEYS
    assert "summary" not in saved and "samples" not in saved
    assert saved["max_concurrency"] == 16 and saved["num_prompts"] == 32
    assert saved["backend"] == "openai" and saved["model_id"] == "m"
    assert saved["request_rate"] == "inf"  # vLLM's spelling of "all at once"
    assert saved["completed"] == 2 and saved["output_throughput"] == pytest.approx(11.0)
    chat = vllm_header(LoadConfig("u", request_rate=2.0), "", 1)
    assert chat["backend"] == "openai-chat" and chat["request_rate"] == 2.0


def test_vllm_cpu_binds_every_core_and_the_default_variant_leaves_vllm_to_choose() -> None:
    both = vllm_env("vllm-cpu", threads=2)
    assert both["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert both["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert both["HF_HUB_OFFLINE"] == "1" and both["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vllm_env("vllm-cpu", threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    default = vllm_env("vllm-cpu-default", threads=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in default
    assert default["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(ValueError, match="unknown vLLM peer"):
        vllm_env("vllm-gpu", threads=2)


def test_vllm_spec_command_line() -> None:
    spec = vllm_spec("vllm-cpu", Path("/p/bin/python"), Path("/hf/smol"), "smol.Q4_1", 64, 2, 2048)
    command = spec.command
    assert command[:3] == ["/p/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert flag("--model") == "/hf/smol" and flag("--served-model-name") == "smol.Q4_1"
    assert flag("--dtype") == "bfloat16" and flag("--max-model-len") == "2048"
    assert flag("--max-num-seqs") == "64" and flag("--host") == "127.0.0.1"
    assert flag("--port") == str(spec.port)
    assert spec.name == "vllm-cpu" and spec.ready_path == "/v1/models"
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert spec.start_timeout_s >= 600  # vLLM's start-up takes minutes on 2 cores
    peer = VllmPeer(Path("/p/bin/python"), Path("/hf/smol"), "smol.Q4_1")
    other = peer.spec("vllm-cpu-default", 16, 2)
    assert other.name == "vllm-cpu-default" and "VLLM_CPU_OMP_THREADS_BIND" not in other.env
    assert other.command[other.command.index("--max-model-len") + 1] == "4096"


def test_a_vllm_peer_that_is_not_installed_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    args = argparse.Namespace(vllm_python=tmp_path / "missing" / "python", hf_folder=None)
    model = tmp_path / "m.gguf"
    assert prepare_vllm(["vllm-cpu", "vllm-cpu-default"], model, args, console) is None
    assert "vLLM not installed" in out.getvalue()
    assert "skipping vllm-cpu, vllm-cpu-default" in out.getvalue()
    out.truncate(0)
    assert prepare_vllm(["llama-server"], model, args, console) is None  # none wanted
    assert out.getvalue() == ""
