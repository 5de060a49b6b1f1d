"""RoPE settings laid over a model's in either spelling, llama-server's flags or vLLM's
``--hf-overrides``: the PyTorch runner reads both as HF names, the llama.cpp runner sets its
context from both and refuses what else an override names; the two spellings at once, or a
stretch without its method or factor, are usage errors before any load. The llama.cpp
runner's context then gives llama-cpp-python's own tokens under the same settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slotserve.cli import build_parser
from slotserve.engine.config import EngineConfig
from slotserve.hosting.config import RunnerConfig
from slotserve.hosting.launch import runner_factory
from slotserve.options import configure
from slotserve.runners.rope import RopeSettings, llama_cpp_rope

QWEN_YARN = ("--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32768")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rope") / "model.gguf"  # never read: recipes load nothing
    path.write_bytes(b"")
    return path


def _spec(gguf: Path, runner: str, *argv: str) -> Any:
    namespace = build_parser().parse_args(["serve", "--runner", runner, *argv])
    return runner_factory(configure(RunnerConfig, namespace), EngineConfig(), gguf, "m")


def test_llama_server_flags_reach_the_pytorch_runner_as_hf_names(gguf: Path) -> None:
    spec = _spec(gguf, "torch", *QWEN_YARN, "--rope-freq-base", "1e6", "--hf-overrides", '{"a": 1}')
    assert json.loads(spec.load.model_overrides) == {
        "a": 1,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        "rope_theta": 1e6,
    }
    assert json.loads(_spec(gguf, "torch", "--rope-scaling", "none").load.model_overrides) == {
        "rope_scaling": {"rope_type": "default"}
    }
    assert _spec(gguf, "torch").load.model_overrides is None


def test_the_llama_cpp_runner_takes_either_spelling(gguf: Path) -> None:
    expected = RopeSettings("yarn", 4.0, 32768)
    assert llama_cpp_rope(_spec(gguf, "llama.cpp", *QWEN_YARN)) == expected
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}
    given = _spec(gguf, "llama.cpp", "--hf-overrides", json.dumps({"rope_scaling": yarn}))
    assert llama_cpp_rope(given) == expected
    theta = _spec(gguf, "llama.cpp", "--hf-overrides", '{"rope_theta": 5e5}')
    assert llama_cpp_rope(theta) == RopeSettings(theta=5e5)
    assert llama_cpp_rope(_spec(gguf, "llama.cpp")) == RopeSettings()


@pytest.mark.parametrize(
    ("runner", "argv", "message"),
    [
        ("torch", ("--rope-scale", "2"), "need --rope-scaling linear or yarn"),
        ("llama.cpp", ("--rope-scaling", "yarn"), "needs --rope-scale"),
        ("torch", ("--rope-scaling", "linear", "--rope-scale", "2", "--hf-overrides",
                   '{"rope_scaling": {"rope_type": "yarn", "factor": 2}}'), "give one"),
        ("llama.cpp", ("--rope-freq-base", "1e6", "--hf-overrides", '{"rope_theta": 1e5}'),
         "give one"),
        ("llama.cpp", ("--hf-overrides", '{"max_position_embeddings": 65536}'),
         "max_position_embeddings: the llama.cpp runner lays only rope_scaling and rope_theta"),
        ("llama.cpp", ("--hf-overrides", '{"rope_scaling": {"rope_type": "llama3", "factor": 8}}'),
         "rope_type 'llama3'"),
        ("llama.cpp", ("--hf-overrides",
                       '{"rope_scaling": {"rope_type": "yarn", "factor": 2, "mscale": 1}}'),
         "rope_scaling mscale"),
        ("llama.cpp", ("--hf-overrides", '{"rope_scaling": {"rope_type": "linear"}}'),
         "linear needs a factor"),
    ],
)  # fmt: skip
def test_settings_that_cannot_be_served_are_refused_before_any_load(
    gguf: Path, runner: str, argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(gguf, runner, *argv)


@pytest.mark.model
def test_the_llama_cpp_runner_stretches_rope_as_llama_cpp_python_does(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linear ×2 from both spellings: the greedy tokens of llama-cpp-python's ``Llama`` under
    the same settings, and not those of the file's own RoPE."""
    import llama_cpp

    from slotserve.engine.core.engine_core import EngineCore
    from slotserve.runners.llama_cpp.runner import LlamaCppRunner
    from tests.runner.conftest import llama_cpp_greedy, llama_cpp_reference
    from tests.runner.engine_runs import generate, greedy

    stretched = llama_cpp_reference(
        model_path,
        monkeypatch,
        rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
        rope_freq_scale=0.5,
    )
    plain = llama_cpp_reference(model_path, monkeypatch)
    overrides = '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'
    config = configure(
        RunnerConfig, build_parser().parse_args(["serve", "--hf-overrides", overrides])
    )
    rope = llama_cpp_rope(config)
    assert rope == RopeSettings("linear", 2.0)
    runner = LlamaCppRunner(model_path, 1, 2048, 512, n_threads=2, rope=rope)
    try:
        prompt = runner.tokenizer.encode("The three primary colours are")
        ours = generate(EngineCore(runner, EngineConfig(num_slots=1)), {"p": (prompt, greedy())})
        expected = llama_cpp_greedy(stretched, prompt, len(ours["p"]))
        assert ours["p"] == expected
        assert expected != llama_cpp_greedy(plain, prompt, len(expected))
    finally:
        runner.close()
        stretched.close()
        plain.close()
