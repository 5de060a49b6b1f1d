"""``--speculative-config`` through the server (SPEC E12): the real ``openai`` client gets the
same greedy text and logprobs as a server without it, streamed deltas add up to it, vLLM's
spec-decode counters appear in ``/metrics`` and ``/v1/slots``, and a bad config is refused at
start-up with a clear message."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, start_server, stop_server

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = (
    "Copy the list exactly.\nList: red apple, green pear, blue plum, red apple, green pear, "
    "blue plum, red apple, green pear, blue plum.\nCopy: red apple, green pear,"
)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("spec-server"), "--slots", "4", "--speculative-config", SPEC
    )
    yield proc
    stop_server(proc)


def _complete(server: ServerProcess) -> tuple[str, list[float]]:
    client = openai.OpenAI(base_url=server.api_url, api_key="none")
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=1
    ).choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return choice.text, [float(x or 0.0) for x in choice.logprobs.token_logprobs]


def test_same_text_as_without_speculation_and_counters(
    spec_server: ServerProcess, server: ServerProcess
) -> None:
    drafted, plain = _complete(spec_server), _complete(server)
    assert drafted == plain
    client = openai.OpenAI(base_url=spec_server.api_url, api_key="none")
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == plain[0]
    metrics = httpx.get(f"{spec_server.base_url}/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_") and "_per_pos" not in line
    }
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert (
        0
        < values["vllm:spec_decode_num_accepted_tokens_total"]
        <= (values["vllm:spec_decode_num_draft_tokens_total"])
    )
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in metrics
    counters = spec_server.slots()["spec_decode"]
    assert counters["num_accepted_tokens"] == values["vllm:spec_decode_num_accepted_tokens_total"]
    assert server.slots()["spec_decode"] is None


def test_a_bad_speculative_config_is_refused_at_start(model_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "serve",
            str(model_path),
            "--speculative-config",
            '{"method": "eagle"}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "not supported" in result.stderr
