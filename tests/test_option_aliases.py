"""Command lines brought from vLLM, SGLang and llama-server: their spellings of our options are
aliases of the option (``option(aliases=...)``), their flags that turn on what is always on
here are accepted and change nothing (``serve_config.ACCEPTED_FLAGS``), and no flag is taken
by a prefix of its name."""

from __future__ import annotations

import os

import pytest

from slotserve.cli import build_parser
from slotserve.config_docs import render
from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import PER_MODEL, LaunchConfig
from slotserve.options import ENV_PREFIX, options
from slotserve.serve_config import ACCEPTED_FLAGS, SERVE_GROUPS, ServeConfig


@pytest.fixture(autouse=True)
def no_slotserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def serve_config(*argv: str) -> ServeConfig:
    return ServeConfig.from_args(build_parser().parse_args(["serve", *argv]))


def test_scheduling_policy_is_the_schedule_policy() -> None:
    vllm = serve_config("--scheduling-policy", "priority").launch.engine
    ours = serve_config("--schedule-policy", "priority").launch.engine
    assert vllm.schedule_policy == ours.schedule_policy == "priority"
    assert vllm == ours
    assert serve_config("--scheduling-policy=fcfs").launch.engine.schedule_policy == "fcfs"


def test_a_bad_value_under_an_alias_is_refused_as_under_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--scheduling-policy", "random"])
    assert exited.value.code == 2
    assert "invalid choice: 'random'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (("--max-num-seqs", "4"), "num_slots", 4),  # vLLM
        (("--max-running-requests", "3"), "num_slots", 3),  # SGLang
        (("--max-num-batched-tokens", "256"), "max_batch_tokens", 256),  # vLLM
        (("--max-queued-requests", "5"), "max_queue", 5),  # SGLang
        (("--chunked-prefill-size", "256"), "prefill_chunk", 256),  # SGLang
        (("--no-enable-prefix-caching",), "prefix_cache", False),  # vLLM
        (("--no-prefix-cache", "--enable-prefix-caching"), "prefix_cache", True),  # last wins
    ],
)
def test_each_alias_sets_its_option(argv: tuple[str, ...], field: str, value: object) -> None:
    assert getattr(serve_config(*argv).launch.engine, field) == value


def test_a_llama_server_command_line_means_what_it_means_there() -> None:
    theirs = serve_config(
        "-m", "model.gguf", "-c", "16384", "-np", "4", "-t", "2", "-b", "1024", "-a", "coder",
        "--jinja", "--cont-batching", "--metrics",
    )  # fmt: skip
    ours = serve_config(
        "--model", "model.gguf", "--ctx-size", "16384", "--slots", "4", "--threads", "2",
        "--max-batch-tokens", "1024", "--served-model-name", "coder",
    )  # fmt: skip
    assert theirs == ours
    assert ours.launch.runner.threads == 2
    assert ours.launch.runner.tensor_parallel_size == 1


def test_an_sglang_command_line_means_what_it_means_there() -> None:
    theirs = serve_config("--model-path", "folder", "--tp", "1", "--chunked-prefill-size", "256")
    ours = serve_config(
        "--model", "folder", "--tensor-parallel-size", "1", "--prefill-chunk", "256"
    )
    assert theirs == ours


def test_llama_servers_threads_minus_one_is_every_core() -> None:
    assert serve_config("-t", "-1").launch.runner.threads == 0
    assert serve_config("--threads", "3").launch.runner.threads == 3


@pytest.mark.parametrize("prefix", ["--thr", "--max-batch", "--served"])
def test_a_prefix_of_a_flag_is_refused(prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", prefix, "2"])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_the_last_spelling_given_wins() -> None:
    engine = serve_config("--slots", "2", "--max-num-seqs", "6").launch.engine
    assert engine.num_slots == 6


def test_accepted_flags_change_nothing() -> None:
    assert serve_config(*ACCEPTED_FLAGS) == serve_config()


def test_aliases_are_command_line_spellings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a variable: SLOTSERVE_SCHEDULING_POLICY means nothing.
    monkeypatch.setenv(ENV_PREFIX + "SCHEDULING_POLICY", "priority")
    assert serve_config().launch.engine.schedule_policy == "fcfs"
    # Not a POST /models/load field.
    with pytest.raises(ValueError, match="unknown options: scheduling_policy"):
        LaunchConfig().with_options({"scheduling_policy": "priority"})


def test_every_alias_is_unique_and_listed_on_the_configuration_page() -> None:
    page = render()
    spellings = [f for _, _, c in SERVE_GROUPS for opt in options(c).values() for f in opt.flags]
    assert len(spellings) == len(set(spellings))
    for config in PER_MODEL:
        for opt in options(config).values():
            for alias in opt.aliases:
                assert f"| `{alias}` | `{opt.flag}` |" in page
    for flag in ACCEPTED_FLAGS:
        assert f"| `{flag}` |" in page


def test_chat_keeps_its_own_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    assert options(EngineConfig)["num_slots"].aliases  # serve's --slots has aliases ...
    with pytest.raises(SystemExit):  # ... which chat, one conversation, does not take
        build_parser().parse_args(["chat", "--max-num-seqs", "2"])
    assert "--max-num-seqs" in capsys.readouterr().err
