"""Configuration by flags and SLOTSERVE_* environment variables, and start-up errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from slotserve.cli import build_parser
from slotserve.hosting.source import ModelUnavailableError, resolve_model_path
from slotserve.options import parse_cache_budget


def test_environment_sets_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_SLOTS", "3")
    monkeypatch.setenv("SLOTSERVE_PORT", "9999")
    monkeypatch.setenv("SLOTSERVE_FLASH_ATTN", "off")
    args = build_parser().parse_args(["serve", "--port", "8001"])
    assert (args.slots, args.port, args.flash_attn) == (3, 8001, False)
    assert build_parser().parse_args(["serve", "--flash-attn"]).flash_attn is True
    assert args.model is None and args.host == "127.0.0.1"


def test_missing_model_file_is_a_clear_error() -> None:
    with pytest.raises(ModelUnavailableError, match="not found"):
        resolve_model_path("/no/such/model.gguf")
    result = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "serve", "/no/such/model.gguf"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Model not found" in result.stderr and "/no/such/model.gguf" in result.stderr


def test_bad_engine_limits_are_refused_before_loading() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "serve", "--slots", "8", "--max-batch-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "max_batch_tokens" in result.stderr


def test_prefix_cache_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve"])
    assert args.prefix_cache is True and args.prefix_cache_budget is None
    monkeypatch.setenv("SLOTSERVE_PREFIX_CACHE", "0")
    monkeypatch.setenv("SLOTSERVE_PREFIX_CACHE_BUDGET", "512MiB")
    args = build_parser().parse_args(["serve"])
    assert args.prefix_cache is False and args.prefix_cache_budget == (None, 512 * 2**20)
    args = build_parser().parse_args(["serve", "--prefix-cache", "--prefix-cache-budget", "20000"])
    assert args.prefix_cache is True and args.prefix_cache_budget == (20000, None)
    assert parse_cache_budget("1.5 GB") == (None, 1_500_000_000)
    for bad in ("lots", "12 parsecs", "-5"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid budget"):
            parse_cache_budget(bad)


def test_prefill_chunk_below_the_models_grain_is_refused() -> None:
    # The grain is the model's on its runner (llama.cpp's 64), known once it is loaded: the
    # load fails and the server exits.
    serve = [sys.executable, "-m", "slotserve.cli", "serve", "--runner", "llama.cpp"]
    result = subprocess.run(
        [*serve, "--prefill-chunk", "32", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "prefill_chunk must be at least the grain (64)" in result.stderr
    assert "the model failed to load" in result.stderr


def test_unsupported_architecture_is_refused_before_loading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "hidden_size": 8}')
    result = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "'mamba' is not supported by the PyTorch runner" in result.stderr
    assert "qwen3" in result.stderr and "gemma3_text" in result.stderr


def test_model_ids_resolve_through_the_local_hf_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny-llm"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-llm") == snapshot
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_path("acme/tiny-llm") == snapshot
    with pytest.raises(ModelUnavailableError, match="nothing is downloaded"):
        resolve_model_path("acme/absent")
