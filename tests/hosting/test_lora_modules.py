"""``--lora-modules`` as vLLM takes it: several at once or flag by flag, ``NAME=PATH`` or a JSON
object; both runners take them."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.cli import build_parser
from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import RunnerConfig
from slotserve.hosting.launch import parse_lora_module, runner_factory
from slotserve.options import configure


def _serve_config(*argv: str) -> RunnerConfig:
    namespace = build_parser().parse_args(["serve", *argv])
    return configure(RunnerConfig, namespace)


def test_several_adapters_after_one_flag_or_one_per_flag() -> None:
    together = _serve_config("--lora-modules", "a=/x", "b=/y")
    apart = _serve_config("--lora-modules", "a=/x", "--lora-modules", "b=/y")
    assert together.lora_modules == apart.lora_modules == ("a=/x", "b=/y")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=/srv/sql-lora", ("sql", "/srv/sql-lora")),
        ("eq=/a=b", ("eq", "/a=b")),
        ('{"name": "sql", "path": "/srv/sql", "base_model_name": "q"}', ("sql", "/srv/sql")),
    ],
)
def test_a_module_is_name_and_path(text: str, expected: tuple[str, str]) -> None:
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text", ["sql", "=/srv", "sql=", '{"name": "sql"}'])
def test_a_malformed_module_names_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(text)


def test_both_runners_take_the_adapters_and_their_limits(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"  # never read: the recipe is made without loading
    gguf.write_bytes(b"")
    config = _serve_config("--lora-modules", "a=/x.gguf", "--max-loras", "3")
    spec = runner_factory(config, EngineConfig(), gguf, "m")
    assert spec.lora_modules == (("a", "/x.gguf"),) and spec.max_loras == 3  # type: ignore[attr-defined]
    config = _serve_config("--lora-modules", "a=/x", "--max-lora-rank", "16")
    spec = runner_factory(config, EngineConfig(), tmp_path, "m")
    assert spec.load.lora_modules == (("a", "/x"),) and spec.load.max_lora_rank == 16  # type: ignore[attr-defined]
