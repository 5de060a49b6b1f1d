"""The option declarations and what is derived from them: the serve and chat flags and their
SLOTSERVE_* variables (names and defaults are a contract), the typed configurations, the
POST /models/load body, and docs/configuration.md."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from slotserve.chat.command import local_configs
from slotserve.cli import build_parser
from slotserve.config_docs import COMMAND, render
from slotserve.engine.config import SpeculativeConfig
from slotserve.hosting.config import LaunchConfig, RunnerConfig
from slotserve.hosting.registry import ModelRegistry
from slotserve.hosting.served import ModelLaunch
from slotserve.options import ENV_PREFIX, CacheBudget, options
from slotserve.runners.options import LlamaCppConfig, TorchConfig
from slotserve.serve_config import ServeConfig
from slotserve.server.app import create_app
from slotserve.server.metrics import ServerMetrics
from slotserve.server.serving import ServingContext
from tests.conftest import local_client
from tests.fake_runner import FakeRunner
from tests.serve_flags import CHAT_MODEL_FLAGS, ENV_VALUES, SERVE_FLAGS

DOCS = Path(__file__).parent.parent / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def no_slotserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def subparser(command: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices[command]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def flags_of(parser: argparse.ArgumentParser) -> dict[str, tuple[tuple[str, ...], Any]]:
    return {
        a.dest: (tuple(a.option_strings), a.default) for a in parser._actions if a.dest != "help"
    }


def test_every_serve_flag_keeps_its_name_variable_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = flags_of(subparser("serve"))
    assert found == {dest: (flags, default) for dest, flags, _, default in SERVE_FLAGS}
    for dest, _, variable, default in SERVE_FLAGS:
        if variable is None:
            continue
        text, expected = ENV_VALUES.get(variable, _other_value(default))
        monkeypatch.setenv(ENV_PREFIX + variable, text)
        changed = vars(subparser("serve").parse_args([]))
        monkeypatch.delenv(ENV_PREFIX + variable)
        assert changed[dest] == expected, variable


def _other_value(default: Any) -> tuple[str, Any]:
    if isinstance(default, bool):
        return ("0" if default else "1"), not default
    if isinstance(default, int | float):
        return "3", type(default)(3)
    return "elsewhere", "elsewhere"


def test_chat_takes_serves_model_flags_with_a_slots_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = flags_of(subparser("chat"))
    for dest, flags, _, default in CHAT_MODEL_FLAGS:
        assert found[dest] == (flags, default)
    monkeypatch.setenv("SLOTSERVE_SLOTS", "6")  # a server's: not the chat's
    monkeypatch.setenv("SLOTSERVE_CHAT_SLOTS", "2")
    monkeypatch.setenv("SLOTSERVE_KV_MEMORY", "1GiB")  # a flag chat has not: serve's variable
    monkeypatch.setenv("SLOTSERVE_MAX_BATCH_TOKENS", "256")
    args = subparser("chat").parse_args(["--threads", "3"])
    engine, runner = local_configs(args)
    assert (engine.num_slots, engine.max_batch_tokens) == (2, 256)
    assert engine.request_timeout_s is None  # a reply at the terminal runs until Ctrl-C
    assert (runner.threads, runner.kv_memory) == (3, 2**30)


def test_the_flags_make_typed_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_SPECULATIVE_CONFIG", '{"method": "ngram"}')
    args = subparser("serve").parse_args(
        [
            "m.gguf",
            "--model",
            "a.gguf=a",
            "--model",
            "b",
            "--slots",
            "4",
            "--request-timeout",
            "0",
            "--prefix-cache-budget",
            "20000",
            "--no-prefix-cache",
            "--kv-memory",
            "2GiB",
            "-tp",
            "2",
            "--enable-auto-tool-choice",
            "--no-engine-process",
        ]
    )
    config = ServeConfig.from_args(args)
    assert config.models.model == "m.gguf" and config.models.models == ("a.gguf=a", "b")
    engine = config.launch.engine
    assert engine.num_slots == 4 and engine.request_timeout_s is None
    assert engine.prefix_cache_budget == CacheBudget(tokens=20000) and not engine.prefix_cache
    assert engine.speculative == SpeculativeConfig()
    assert config.launch.runner.kv_memory == 2**31
    assert config.launch.runner.tensor_parallel_size == 2
    assert config.server.engine_process is False and config.replicas.replicas == 0
    # Each value is checked as the configuration takes it.
    bad = subparser("serve").parse_args(["--slots", "8", "--max-batch-tokens", "4"])
    with pytest.raises(ValueError, match="max_batch_tokens"):
        ServeConfig.from_args(bad)


def test_a_bad_speculative_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        subparser("serve").parse_args(["--speculative-config", '{"method": "eagle"}'])
    assert exited.value.code == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_each_runner_has_its_own_options_and_serve_takes_both() -> None:
    llama_cpp, torch = options(LlamaCppConfig), options(TorchConfig)
    assert {"ctx_size", "flash_attn"} <= set(llama_cpp) and "dtype" not in llama_cpp
    assert {"dtype", "kv_memory", "tensor_parallel_size"} <= set(torch) and "ctx_size" not in torch
    assert set(options(RunnerConfig)) == set(llama_cpp) | set(torch)
    config = RunnerConfig(ctx_size=4096, dtype="float32")
    assert isinstance(config, LlamaCppConfig) and isinstance(config, TorchConfig)


def test_load_options_are_read_as_the_flags_are() -> None:
    base = LaunchConfig(runner=RunnerConfig(ctx_size=4096))
    config = base.with_options(
        {
            "slots": 2,
            "kv_memory": "2GiB",
            "prefix_cache_budget": "512MiB",
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 8},
            "request_timeout": 0,
            "runner": "torch",
        }
    )
    assert config.engine.num_slots == 2 and config.engine.request_timeout_s is None
    assert config.engine.prefix_cache_budget == CacheBudget(bytes=512 * 2**20)
    assert config.engine.speculative == SpeculativeConfig(num_speculative_tokens=8)
    assert (config.runner.runner, config.runner.kv_memory) == ("torch", 2**31)
    assert config.runner.ctx_size == 4096  # the server's
    assert base.with_options({"kv_memory": 1024}).runner.kv_memory == 1024
    assert base.with_options({"speculative_config": '{"method": "ngram"}'}).engine.speculative
    for bad, message in (
        ({"runner": "?"}, "runner must be one of"),
        ({"kv_memory": "lots"}, "invalid size"),
        ({"speculative_config": {"method": "eagle"}}, "not supported"),
        ({"slots": 600}, "max_batch_tokens"),
        ({"host": "0.0.0.0"}, "unknown options: host"),
        ({"prefix_cache_ram": -1}, "prefix_cache_ram must be >= 0"),
        ({"prefix_cache_dir_size": "lots"}, "invalid size"),
        ({"prefix_cache_dir": "a\0b"}, "prefix_cache_dir must be a folder's path"),
    ):
        with pytest.raises((ValueError, argparse.ArgumentTypeError), match=message):
            base.with_options(bad)


def _app(make: Any = None) -> TestClient:
    metrics = ServerMetrics()
    registry = ModelRegistry(make, on_outputs=metrics.observe)
    return local_client(create_app(ServingContext(registry, metrics)))


def test_the_load_body_is_documented_in_the_openapi_schema() -> None:
    schema = _app().app.openapi()  # type: ignore[attr-defined]
    body = schema["paths"]["/models/load"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/LoadModelRequest"}
    load = schema["components"]["schemas"]["LoadModelRequest"]
    assert load["additionalProperties"] is False and load["required"] == ["model"]
    fields = load["properties"]
    for name in ("slots", "ctx_size", "kv_memory", "speculative_config", "chat_template"):
        assert fields[name]["description"], name
    assert {"minimum": 1, "type": "integer"} in fields["slots"]["anyOf"]
    assert {"enum": ["auto", "llama.cpp", "torch"], "type": "string"} in fields["runner"]["anyOf"]


def test_the_load_route_passes_the_options_it_was_given() -> None:
    seen: list[LaunchConfig] = []

    def make(name: str, path: Path, options: Mapping[str, Any]) -> ModelLaunch:
        config = LaunchConfig().with_options(options)
        seen.append(config)
        slots = config.engine.num_slots
        return ModelLaunch(name, lambda: FakeRunner(num_slots=slots), config.engine)

    with _app(make) as http:
        body = {"model": "x", "path": "/anywhere", "slots": 2, "prefix_cache_budget": "1MiB"}
        response = http.post("/models/load", json=body)
        assert response.status_code == 200, response.text
        assert seen[-1].engine.num_slots == 2
        assert seen[-1].engine.prefix_cache_budget == CacheBudget(bytes=2**20)
        for bad, param in (({"runner": "?"}, "runner"), ({"bogus": 1}, "bogus")):
            refused = http.post("/models/load", json={"model": "y", **bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        refused = http.post("/models/load", json={"model": "y", "path": "/a", "kv_memory": "x"})
        assert refused.status_code == 400 and "invalid size" in refused.text


def test_the_configuration_page_is_the_generated_one() -> None:
    assert DOCS.read_text() == render(), f"docs/configuration.md is stale: run {COMMAND}"


def test_replicas_are_started_without_the_deployments_own_flags() -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed")
    from slotserve.replicas.launch import replica_argv

    argv = ["m.gguf", "--replicas", "2", "--port=9000", "--slots", "4", "--host", "0.0.0.0"]
    argv += ["--replica-routing", "pow2", "--ray-address=auto", "-tp", "1"]
    assert replica_argv(argv) == ["m.gguf", "--slots", "4", "-tp", "1"]
