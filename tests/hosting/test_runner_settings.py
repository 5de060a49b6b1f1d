"""Runner settings as ``serve`` parses them into each runner's recipe: ``--lora-modules`` as
vLLM takes it (several at once or flag by flag, ``NAME=PATH`` or a JSON object), for both
runners; llama.cpp's GPU offload, refused by a CPU-only build; each runner's settings the other
refuses before any load, but for a sequence's room, read in either runner's spelling; which
runner ``--runner auto`` serves a .gguf file on, and the log line saying why."""

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
    config = _serve_config("--runner", "llama.cpp", *flags)
    with pytest.raises(ValueError, match=f"{flags[0]}: a PyTorch runner setting"):
        runner_factory(config, EngineConfig(), gguf, "m")


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
            "m: served by the llama.cpp runner (--runner auto, a .gguf file; not the PyTorch "
            "runner: the file could not be read",
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


def _header_only_gguf(path: Path, arch: str, matrix_type: str) -> Path:
    """A small decoder's metadata and one matrix of ``matrix_type``: all the runner choice
    reads of a file (no weights)."""
    import gguf
    import numpy as np

    from slotserve.bench.hf_gguf import gguf_writer

    shape: dict[str, float] = {"num_hidden_layers": 1, "vocab_size": 256}
    shape |= {"max_position_embeddings": 512}
    shape |= {"hidden_size": 256, "intermediate_size": 512, "rms_norm_eps": 1e-5}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    writer = gguf_writer(path, arch, shape)
    kind = gguf.GGMLQuantizationType[matrix_type]
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    codes = np.zeros((256, 256 // block * block_bytes), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", codes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _chosen(caplog: pytest.LogCaptureFixture, path: Path, *argv: str) -> tuple[str, str]:
    """(the runner, why) ``--runner auto`` serves ``path`` on, as the start-up log says."""
    with caplog.at_level("INFO", logger="slotserve.hosting.launch"):
        spec = runner_factory(_serve_config(*argv), EngineConfig(), path, "m")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("m: served by")]
    return type(spec).__name__, said[-1]


def test_auto_serves_a_gguf_on_the_pytorch_runner_where_its_kernels_take_it_as_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch", reason="the PyTorch runner is an extra: make install-torch")
    from slotserve.runners.pytorch.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("the CPU kernels cannot run on this machine (x86-64 with AVX2 only)")
    q4_0 = _header_only_gguf(tmp_path / "q4_0.gguf", "llama", "Q4_0")
    assert _chosen(caplog, q4_0) == (
        "TorchSpec",
        "m: served by the PyTorch runner (--runner auto, a .gguf file it serves from its "
        "weights as stored; --runner llama.cpp serves it on llama.cpp, docs/runners.md "
        "compares the two)",
    )
    q2_k = _header_only_gguf(tmp_path / "q2_k.gguf", "llama", "Q2_K")
    assert _chosen(caplog, q2_k) == (
        "LlamaCppSpec",
        "m: served by the llama.cpp runner (--runner auto, a .gguf file; not the PyTorch "
        "runner: its Q2_K matrices would be dequantized)",
    )
    phi2 = _header_only_gguf(tmp_path / "phi2.gguf", "phi2", "Q4_0")
    assert _chosen(caplog, phi2)[1].endswith("no family for its architecture 'phi2')")


def test_auto_serves_a_gguf_on_the_runner_whose_own_settings_are_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch", reason="the PyTorch runner is an extra: make install-torch")
    q2_k = _header_only_gguf(tmp_path / "q2_k.gguf", "llama", "Q2_K")
    runner, why = _chosen(caplog, q2_k, "--quantization", "none")
    assert runner == "TorchSpec" and "--quantization, which only it reads" in why
    q4_0 = _header_only_gguf(tmp_path / "q4_0.gguf", "llama", "Q4_0")
    runner, why = _chosen(caplog, q4_0, "--no-flash-attn")
    assert runner == "LlamaCppSpec" and "--no-flash-attn, which only it reads" in why
    # llama.cpp's adapters are GGUF files; the PyTorch runner's PEFT folders.
    runner, why = _chosen(caplog, q4_0, "--lora-modules", "a=/x.gguf")
    assert runner == "LlamaCppSpec" and "GGUF adapters" in why
