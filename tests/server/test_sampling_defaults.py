"""Sampling defaults: a request's field, over the server's flag, over the model's own
recommendation (``generation_config.json``, GGUF ``general.sampling.*``), over its ecosystem's
defaults; shown per model in ``/v1/models``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.engine.sampling_defaults import (
    LLAMA_SERVER,
    NEUTRAL,
    SamplingDefaults,
    from_generation_config,
    from_gguf,
)
from slotserve.hosting.config import ModelOptions
from slotserve.server.openai.params import sampling_params_of
from slotserve.server.openai.protocol import CompletionRequest
from tests.conftest import ServerProcess, start_server, stop_server

LLAMA_SERVER_DICT = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
}


def params(defaults: SamplingDefaults, **fields: Any) -> dict[str, Any]:
    body = CompletionRequest(prompt="x", **fields)
    p = sampling_params_of(body, None, None, None, defaults=defaults)
    return {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
    }


def test_each_field_comes_from_the_first_layer_that_sets_it() -> None:
    flags = SamplingDefaults(temperature=0.3)
    model = SamplingDefaults(temperature=0.6, top_k=20, top_p=0.9)
    in_force = flags.over(model, LLAMA_SERVER)
    assert in_force == SamplingDefaults(0.3, 0.9, 20, 0.05, 1.0)
    assert params(in_force) == {**in_force.as_dict()}
    # A request's field wins over all of them, a zero included (greedy stays greedy).
    assert params(in_force, temperature=0.0, top_k=0, min_p=0.0)["temperature"] == 0.0
    assert params(in_force, temperature=0.0, top_k=0, min_p=0.0)["top_k"] == 0
    assert params(in_force, top_p=0.5, repetition_penalty=1.2) == {
        **in_force.as_dict(),
        "top_p": 0.5,
        "repetition_penalty": 1.2,
    }


def test_no_defaults_at_all_are_the_neutral_ones() -> None:
    assert params(SamplingDefaults()) == NEUTRAL.as_dict()


def test_model_files_are_read_and_values_out_of_range_dropped() -> None:
    hf = from_generation_config(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "min_p": 3}
    )
    assert hf == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    gguf = {"general.sampling.temp": 0.7, "general.sampling.penalty_repeat": "1.05"}
    assert from_gguf(gguf.get) == SamplingDefaults(temperature=0.7, repetition_penalty=1.05)
    assert from_gguf({"general.sampling.temp": "hot"}.get) == SamplingDefaults()


def test_flags_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        ModelOptions(temperature=3.0)
    with pytest.raises(ValueError, match="repeat_penalty"):
        ModelOptions(repeat_penalty=0.0)
    assert ModelOptions(top_k=5, min_p=0.1).sampling_defaults == SamplingDefaults(
        top_k=5, min_p=0.1
    )


def test_an_hf_folder_recommends_its_generation_config(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from slotserve.runners.pytorch.load.checkpoint import sampling_defaults

    assert sampling_defaults(tmp_path) == NEUTRAL  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "bos_token_id": 1})
    )
    assert sampling_defaults(tmp_path) == SamplingDefaults(0.7, 0.8, 20, 0.0, 1.0)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == NEUTRAL


def card(server: ServerProcess) -> dict[str, Any]:
    (entry,) = httpx.get(f"{server.api_url}/models", timeout=10).json()["data"]
    return dict(entry)


def test_a_gguf_without_sampling_keys_gets_llama_servers_defaults(server: ServerProcess) -> None:
    assert card(server)["sampling_defaults"] == LLAMA_SERVER_DICT


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Greedy unless a request asks otherwise: --temperature 0."""
    proc = start_server(
        tmp_path_factory.mktemp("greedy"), "--slots", "2", "--temperature", "0", "--top-k", "7"
    )
    yield proc
    stop_server(proc)


def test_flags_override_the_models_defaults(greedy_server: ServerProcess) -> None:
    assert card(greedy_server)["sampling_defaults"] == {
        **LLAMA_SERVER_DICT,
        "temperature": 0.0,
        "top_k": 7,
    }


def complete(server: ServerProcess, **fields: Any) -> str:
    reply = httpx.post(
        f"{server.api_url}/completions",
        json={"prompt": "Once upon a time", "max_tokens": 24, **fields},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def test_a_request_field_overrides_the_flag(greedy_server: ServerProcess) -> None:
    # The flag's temperature 0 is greedy: the seed changes nothing.
    assert complete(greedy_server, seed=1) == complete(greedy_server, seed=2)
    # The request's own temperature samples: seeded, so each seed's text is reproducible.
    hot = [complete(greedy_server, seed=s, temperature=2.0, top_k=-1) for s in (1, 2, 3)]
    assert len(set(hot)) > 1
    assert complete(greedy_server, seed=1, temperature=2.0, top_k=-1) == hot[0]
