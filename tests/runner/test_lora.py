"""LoRA adapters on the PyTorch runner (SPEC S11): greedy tokens equal transformers + PEFT on
the same adapter (applied and merged); a request's tokens are the same alone and beside
requests with other adapters or none; the prefix cache never hands one adapter's KV to
another; adapters it cannot serve are refused with the reason, the runner unharmed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.bench.lora_adapters import peft_model, random_adapter
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.conftest import require_batch_invariance
from tests.runner.engine_runs import (
    adapter_ids,
    check_prefix_cache_never_crosses_adapters,
    check_tokens_alone_equal_tokens_beside_other_adapters,
    generate,
    greedy,
)

TOKENS = 16


@pytest.fixture(scope="module")
def adapters(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two adapters: every projection at rank 8, and attention only at rank 4 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    return [
        random_adapter(hf_checkpoint, root / "all", seed=1),
        random_adapter(
            hf_checkpoint,
            root / "attention",
            seed=2,
            rank=4,
            targets=("q_proj", "v_proj", "o_proj"),
            use_rslora=True,
        ),
    ]


def _runner(checkpoint: Path, adapters: list[Path], **options: object) -> TorchRunner:
    modules = tuple((f"a{i}", str(path)) for i, path in enumerate(adapters))
    return TorchRunner(
        TorchLoadConfig(checkpoint, num_slots=6, max_model_len=512, lora_modules=modules, **options)  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def fp32_lora_runner(hf_checkpoint: Path, adapters: list[Path]) -> Iterator[TorchRunner]:
    runner = _runner(hf_checkpoint, adapters, dtype="float32")
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def lora_runner(hf_checkpoint: Path, adapters: list[Path]) -> Iterator[TorchRunner]:
    runner = _runner(hf_checkpoint, adapters)  # bfloat16: the CPU kernels where they run
    yield runner
    runner.close()


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]),
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize("merged", [False, True], ids=["peft", "merged"])
@pytest.mark.parametrize("which", [0, 1], ids=["all-modules", "attention-rslora"])
def test_greedy_tokens_equal_transformers_with_peft(
    fp32_lora_runner: TorchRunner,
    hf_checkpoint: Path,
    adapters: list[Path],
    which: int,
    merged: bool,
) -> None:
    reference = peft_model(hf_checkpoint, adapters[which], merged=merged)
    core = EngineCore(fp32_lora_runner, EngineConfig(num_slots=6))
    prompts = [fp32_lora_runner.tokenizer.encode(p) for p in PROMPTS[:3]]
    adapter = adapter_ids(fp32_lora_runner)[which]
    jobs = {f"p{i}": (p, greedy(TOKENS)) for i, p in enumerate(prompts)}
    ours = generate(core, jobs, adapters=dict.fromkeys(jobs, adapter))
    base = generate(core, jobs)
    for i, prompt in enumerate(prompts):
        assert ours[f"p{i}"] == _hf_greedy(reference, prompt), f"prompt {i}"
    assert ours != base, "the adapter changed no token: the test would not see it missing"


def test_tokens_alone_equal_tokens_beside_other_adapters(lora_runner: TorchRunner) -> None:
    require_batch_invariance(lora_runner)
    prompts = [lora_runner.tokenizer.encode(p) for p in PROMPTS[:3]]
    check_tokens_alone_equal_tokens_beside_other_adapters(lora_runner, prompts, TOKENS)


def test_prefix_cache_never_crosses_adapters(lora_runner: TorchRunner) -> None:
    prompt = lora_runner.tokenizer.encode(PROMPTS[4] * 3)
    check_prefix_cache_never_crosses_adapters(lora_runner, prompt, TOKENS)


def test_an_unloaded_adapter_is_refused_and_its_requests_end(
    lora_runner: TorchRunner, adapters: list[Path], tmp_path: Path
) -> None:
    core = EngineCore(lora_runner, EngineConfig(num_slots=6, prefix_cache=False))
    prompt = lora_runner.tokenizer.encode(PROMPTS[0])
    info = core.call_adapter("extra", str(adapters[0]))
    assert info.adapter_id == adapter_ids(lora_runner)[0]  # the same files: the same id
    core.call_adapter("extra", None)  # a0 still holds the same adapter
    assert info.adapter_id in {a.adapter_id for a in lora_runner.adapters}
    solo_id = core.call_adapter(
        "solo", str(_edited(adapters[1], tmp_path, lora_alpha=3))
    ).adapter_id
    assert solo_id not in adapter_ids(lora_runner)
    core.add_request(EngineCoreRequest("r", prompt, greedy(TOKENS), adapter=solo_id))
    core.step()
    core.call_adapter("solo", None)
    (out,) = [o for o in core.step() if o.request_id == "r"]
    assert out.finished and "unloaded" in (out.error or "")
    with pytest.raises(InvalidRequestError, match="not loaded"):
        core.add_request(EngineCoreRequest("s", prompt, greedy(TOKENS), adapter=solo_id))


def _corrupt(folder: Path, tmp: Path) -> Path:
    out = tmp / "corrupt"
    out.mkdir()
    (out / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    data = (folder / "adapter_model.safetensors").read_bytes()
    (out / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return out


def _edited(folder: Path, tmp: Path, **changes: object) -> Path:
    out = tmp / "edited"
    out.mkdir()
    settings = json.loads((folder / "adapter_config.json").read_text()) | changes
    (out / "adapter_config.json").write_text(json.dumps(settings))
    (out / "adapter_model.safetensors").write_bytes(
        (folder / "adapter_model.safetensors").read_bytes()
    )
    return out


def _with_vision_keys(folder: Path, tmp: Path) -> Path:
    """The adapter plus a vision tower's LoRA on its layer 0 attention, shaped exactly like the
    decoder's layer 0 q_proj: only the key's prefix tells them apart."""
    from safetensors.torch import load_file, save_file

    out = _edited(folder, tmp)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    tower = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    decoder = "base_model.model.model.layers.0.self_attn.q_proj"
    for half in ("A", "B"):
        tensors[f"{tower}.lora_{half}.weight"] = tensors[f"{decoder}.lora_{half}.weight"].clone()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda folder, tmp: tmp / "missing", "not a folder"),
        (_corrupt, "cannot be read"),
        (lambda folder, tmp: _edited(folder, tmp, use_dora=True), "use_dora"),
        (lambda folder, tmp: _edited(folder, tmp, peft_type="IA3"), "only LoRA"),
        (_with_vision_keys, "2 of its .* tensors adapt modules .*vision_tower"),
    ],
    ids=["missing", "truncated", "dora", "not-lora", "vision-tower"],
)
def test_adapters_it_cannot_serve_are_refused_with_the_reason(
    lora_runner: TorchRunner, adapters: list[Path], tmp_path: Path, make: object, message: str
) -> None:
    before = list(lora_runner.adapters)
    folder = make(adapters[0], tmp_path)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        lora_runner.load_adapter("bad", folder)
    assert list(lora_runner.adapters) == before


def test_a_rank_over_the_limit_and_another_base_model_are_refused(
    hf_checkpoint: Path, adapters: list[Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="over --max-lora-rank 4"):
        _runner(hf_checkpoint, adapters[:1], max_lora_rank=4, load_format="dummy")
    other = tmp_path / "other-base"
    other.mkdir()
    settings = json.loads((hf_checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(settings | {"intermediate_size": 512}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (hf_checkpoint / name).is_file():
            (other / name).write_text((hf_checkpoint / name).read_text())
    with pytest.raises(ValueError, match="trained for another base model"):
        _runner(other, adapters[:1], load_format="dummy")


def test_adapters_past_max_loras_are_refused_until_one_is_unloaded(
    hf_checkpoint: Path, adapters: list[Path]
) -> None:
    runner = _runner(hf_checkpoint, adapters[:1], max_loras=1, load_format="dummy")
    try:
        with pytest.raises(ValueError, match="the --max-loras limit: unload one before loading a1"):
            runner.load_adapter("a1", adapters[1])
        assert [a.name for a in runner.adapters] == ["a0"]
        runner.load_adapter("again", adapters[0])  # the same files: no second copy held
        runner.unload_adapter("a0")
        runner.unload_adapter("again")
        assert runner.load_adapter("a1", adapters[1]).name == "a1"
    finally:
        runner.close()
    with pytest.raises(ValueError, match=r"max.loras"):
        _runner(hf_checkpoint, adapters, max_loras=1, load_format="dummy")
