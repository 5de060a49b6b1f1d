"""Runner settings as ``serve`` parses them into each runner's recipe: ``--lora-modules`` as
vLLM takes it (several at once or flag by flag, ``NAME=PATH`` or a JSON object), for both
runners; llama.cpp's GPU offload, refused by a CPU-only build; each runner's settings the other
refuses before any load, but for a sequence's room, read in either runner's spelling."""

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


def test_gpu_offload_on_a_cpu_only_llama_cpp_build_is_refused_naming_the_fix(
    tmp_path: Path,
) -> None:
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build offloads to a GPU")
    gguf = tmp_path / "model.gguf"  # never read: the refusal comes first
    gguf.write_bytes(b"")
    for flag in ("--n-gpu-layers", "-ngl"):
        config = _serve_config(flag, "99")
        with pytest.raises(ValueError, match="CMAKE_ARGS"):
            runner_factory(config, EngineConfig(), gguf, "m")


@pytest.mark.parametrize(("layers", "share"), [(0, 0.0), (15, 0.5), (99, 1.0), (-1, 1.0)])
def test_offloaded_layers_take_their_share_of_the_estimate(
    model_path: Path, layers: int, share: float
) -> None:
    from slotserve.runners.llama_cpp.frontend import estimate_memory

    need = estimate_memory(model_path, 4, 4096, 512, n_gpu_layers=layers)
    assert need.device_share == share  # SmolLM2-135M: 30 layers
    assert need.host_bytes + need.device_bytes == need.total_bytes


@pytest.mark.parametrize(
    "flags",
    [
        ("--classifier-from-token", "no", "yes"),
        ("--attention-backend", "triton"),
        ("--batch-invariant",),
        ("--enforce-eager",),
    ],
)
def test_pytorch_runner_settings_are_refused_by_the_llama_cpp_runner(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    gguf = tmp_path / "model.gguf"  # never read: the refusal comes first
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{flags[0]}: a PyTorch runner setting"):
        runner_factory(_serve_config(*flags), EngineConfig(), gguf, "m")


@pytest.mark.parametrize(
    "flags", [("--no-flash-attn",), ("--repack", "off"), ("--n-gpu-layers", "10")]
)
def test_llama_cpp_settings_are_refused_by_the_pytorch_runner(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match=rf"{flags[0]}: a llama\.cpp runner setting, unused by"):
        runner_factory(_serve_config(*flags), EngineConfig(), tmp_path, "m")


def test_several_unused_settings_are_named_together(tmp_path: Path) -> None:
    config = _serve_config("--no-flash-attn", "--repack", "off")
    with pytest.raises(ValueError, match=r"--no-flash-attn, --repack: llama\.cpp runner settings"):
        runner_factory(config, EngineConfig(), tmp_path, "m")


def test_a_sequence_s_room_is_read_in_either_runner_s_spelling(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"  # never read: the recipe is made without loading
    gguf.write_bytes(b"")
    engine = EngineConfig(num_slots=4)
    # llama.cpp's --ctx-size is every slot's tokens together; vLLM's --max-model-len one's.
    spec = runner_factory(_serve_config("--max-model-len", "2048"), engine, gguf, "m")
    assert spec.ctx_size == 4 * 2048  # type: ignore[attr-defined]
    spec = runner_factory(_serve_config("--ctx-size", "8192"), engine, tmp_path, "m")
    assert spec.load.max_model_len == 2048  # type: ignore[attr-defined]
    # Both given: the runner's own wins, and the other's is then a setting it does not use.
    both = _serve_config("--ctx-size", "8192", "--max-model-len", "1024")
    with pytest.raises(ValueError, match=r"--ctx-size: a llama\.cpp runner setting"):
        runner_factory(both, engine, tmp_path, "m")
    with pytest.raises(ValueError, match="--max-model-len: a PyTorch runner setting"):
        runner_factory(both, engine, gguf, "m")


@pytest.mark.parametrize(
    ("argv", "gguf", "expected"),
    [
        (
            (),
            True,
            "m: served by the llama.cpp runner (--runner auto, a .gguf file; --runner torch",
        ),
        ((), False, "m: served by the PyTorch runner (--runner auto, an HF checkpoint)"),
        (("--runner", "torch"), True, "m: served by the PyTorch runner (--runner torch)"),
    ],
)
def test_the_log_says_which_runner_serves_and_why(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    argv: tuple[str, ...],
    gguf: bool,
    expected: str,
) -> None:
    path = tmp_path / "model.gguf" if gguf else tmp_path
    if gguf:
        path.write_bytes(b"")  # never read: the recipe is made without loading
    with caplog.at_level("INFO", logger="slotserve.hosting.launch"):
        runner_factory(_serve_config(*argv), EngineConfig(), path, "m")
    assert any(record.getMessage().startswith(expected) for record in caplog.records)
