"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL MoE on the PyTorch runner: images through the vision
tower, M-RoPE (and Qwen3-VL's deepstack features) give transformers' own greedy tokens; the
prefix cache shares KV over the same image only; image and text requests batched give each
its solo tokens (a real server's image requests: ``test_image_server.py``)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.bench.vision_model import (
    FAMILIES,
    TINY_QWEN3_MOE_TEXT,
    TINY_QWEN3_TEXT,
    TINY_QWEN3_VISION,
    picture,
    qwen_vl_folder,
)
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.images import ImageInput
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.runner.engine_runs import alone_then_together, generate, greedy

SIZES = [(64, 48, 1), (100, 60, 2), (40, 90, 3)]  # width, height, seed: three aspect ratios


@pytest.fixture(scope="module")
def vl3_folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_vl_folder(
        hf_checkpoint,
        tmp_path_factory.mktemp("qwen3-vl"),
        TINY_QWEN3_TEXT,
        TINY_QWEN3_VISION,
        max_pixels=32 * 32 * 48,
        family="qwen3_vl",
    )


@pytest.fixture(scope="module")
def vl3_moe_folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_vl_folder(
        hf_checkpoint,
        tmp_path_factory.mktemp("qwen3-vl-moe"),
        TINY_QWEN3_MOE_TEXT,
        TINY_QWEN3_VISION,
        max_pixels=32 * 32 * 48,
        family="qwen3_vl_moe",
    )


FOLDERS = {"qwen2_5_vl": "vl_folder", "qwen3_vl": "vl3_folder", "qwen3_vl_moe": "vl3_moe_folder"}


@pytest.fixture(scope="module", params=list(FOLDERS))
def family_folder(request: pytest.FixtureRequest) -> Path:
    folder: Path = request.getfixturevalue(FOLDERS[request.param])
    return folder


def _runner(path: Path, dtype: str = "float32", **options: Any) -> TorchRunner:
    load = TorchLoadConfig(path, num_slots=4, max_model_len=512, dtype=dtype, **options)
    return TorchRunner(load)


def _image(runner: TorchRunner, width: int, height: int, seed: int) -> ImageInput:
    from PIL import Image

    preparer = runner.tokenizer.image_preparer
    assert preparer is not None
    return preparer.prepare(Image.open(io.BytesIO(picture(width, height, seed))).convert("RGB"))


def _prompt(
    runner: TorchRunner, texts: Sequence[str], images: Sequence[ImageInput]
) -> tuple[list[int], list[ImageInput]]:
    """``texts[0]``, image 0, ``texts[1]``, image 1, ... as ChatML token ids with each image's
    placeholder run, and the images placed."""
    tok = runner.tokenizer
    pad = tok.image_preparer.image_token_id  # type: ignore[union-attr]
    start, end = tok.encode("<|vision_start|>", False), tok.encode("<|vision_end|>", False)
    tokens = tok.encode("<|im_start|>user\n", False)
    placed = []
    for i, text in enumerate(texts):
        tokens += tok.encode(text, False)
        if i < len(images):
            tokens += start
            placed.append(dataclasses.replace(images[i], offset=len(tokens)))
            tokens += [pad] * images[i].length + end
    tokens += tok.encode("<|im_end|>\n<|im_start|>assistant\n", False)
    return tokens, placed


def _transformers_greedy(
    folder: Path, tokens: list[int], images: Sequence[ImageInput], n: int
) -> list[int]:
    import json

    import transformers

    family = json.loads((folder / "config.json").read_text())["model_type"]
    model_class = getattr(transformers, FAMILIES[family][1])
    model: Any = model_class.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.tensor([tokens])
    pixels = torch.cat(
        [torch.frombuffer(bytearray(i.pixels), dtype=torch.float32).view(i.shape) for i in images]
    )
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels,
            image_grid_thw=torch.tensor([i.grid for i in images]),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(tokens) :]]


@pytest.fixture(scope="module")
def runner(vl_folder: Path) -> Iterator[TorchRunner]:
    runner = _runner(vl_folder)
    yield runner
    runner.close()


def test_greedy_tokens_match_transformers_generate_on_images(family_folder: Path) -> None:
    runner = _runner(family_folder)
    try:
        _check_parity(runner, family_folder)
    finally:
        runner.close()


def test_stacked_experts_stored_in_out_load_as_transformers_layout(
    vl3_moe_folder: Path, tmp_path: Path
) -> None:
    """The hub's Qwen3-VL MoE checkpoints store each expert [in, out]; transformers saves
    [out, in]. Both load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub = tmp_path / "hub-layout"
    shutil.copytree(vl3_moe_folder, hub)
    weights = load_file(str(hub / "model.safetensors"))
    turned = {k: v.transpose(1, 2).contiguous() for k, v in weights.items() if ".experts." in k}
    assert turned
    save_file(weights | turned, str(hub / "model.safetensors"), metadata={"format": "pt"})
    outputs = []
    for folder in (vl3_moe_folder, hub):
        runner = _runner(folder)
        try:
            tokens = runner.tokenizer.encode("The experts read this the same way", False)
            core = EngineCore(runner, EngineConfig(num_slots=4))
            outputs.append(generate(core, {"r": (tokens, greedy(12))}))
        finally:
            runner.close()
    assert outputs[0] == outputs[1]


def _check_parity(runner: TorchRunner, folder: Path) -> None:
    assert runner.model_info.accepts_images
    shots = [_image(runner, *size) for size in SIZES]
    assert len({s.grid for s in shots}) == 3
    cases = [
        (["Describe this:"], [shots[0]]),
        (["Compare", "with", "please."], [shots[1], shots[2]]),
        (["A long text before the picture " * 4, "and after it."], [shots[2]]),
    ]
    core = EngineCore(runner, EngineConfig(num_slots=4, prefill_chunk=16))
    for k, (texts, images) in enumerate(cases):
        tokens, placed = _prompt(runner, texts, images)
        ours = generate(core, {f"r{k}": (tokens, greedy(12))}, images={f"r{k}": placed})
        assert ours[f"r{k}"] == _transformers_greedy(folder, tokens, placed, 12), texts


def test_the_same_image_hits_the_cache_and_another_image_does_not(runner: TorchRunner) -> None:
    core = EngineCore(runner, EngineConfig(num_slots=4, prefill_chunk=16, prefix_cache=True))
    first, other = _image(runner, 64, 48, 1), _image(runner, 64, 48, 9)
    assert first.length == other.length and first.digest != other.digest
    tokens, placed = _prompt(runner, ["What is it?"], [first])
    _, placed_other = _prompt(runner, ["What is it?"], [other])
    cached: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    for rid, images in (("a", placed), ("again", placed), ("b", placed_other)):
        core.add_request(EngineCoreRequest(rid, tokens, greedy(8), images=tuple(images)))
        outputs[rid] = []
        while core.scheduler.has_work:
            for out in core.step():
                outputs[rid].extend(t for d in out.deltas for t in d.token_ids)
                if out.finished:
                    cached[rid] = out.num_cached_tokens
    assert outputs["again"] == outputs["a"]
    assert cached["again"] > placed[0].end  # the image's KV came from the cache
    assert cached["b"] <= placed[0].offset  # nothing past the first placeholder is shared
    assert outputs["b"] != outputs["a"]


def test_image_and_text_requests_batched_give_their_solo_tokens(family_folder: Path) -> None:
    runner = _runner(family_folder, dtype="bfloat16")
    try:
        shots = [_image(runner, *size) for size in SIZES]
        prompts = [
            _prompt(runner, ["Look:"], [shots[0]]),
            _prompt(runner, ["Just text, no picture at all."], []),
            _prompt(runner, ["One", "two"], [shots[1], shots[2]]),
        ]
        core = EngineCore(runner, EngineConfig(num_slots=4, max_batch_tokens=48))
        alone, together = alone_then_together(
            core,
            [p[0] for p in prompts],
            greedy(16),
            start_after={"p2": ("p0", 3)},
            images={f"p{i}": p[1] for i, p in enumerate(prompts)},
        )
        assert together == alone
    finally:
        runner.close()


def test_a_stepped_encode_runs_a_piece_a_call_and_equals_an_encode_at_once(
    runner: TorchRunner,
) -> None:
    inputs = runner.image_inputs
    assert inputs is not None
    tower = inputs.encoder.tower
    image = _image(runner, 100, 60, 7)
    stepped = inputs.encoder._stepped  # its gates sit before the tower's linear layers
    assert stepped.pieces >= 4 * len(tower.blocks)  # attention's two, the MLP's two or three
    calls = 1
    while (result := stepped.advance(image.digest, lambda: tower.encode(image), 1)) is None:
        calls += 1
    assert calls == stepped.pieces  # one piece a call, the last one to the end
    whole = stepped.advance("again", lambda: tower.encode(image), stepped.pieces)
    assert whole is not None
    assert all(torch.equal(a, b) for a, b in zip(result, whole, strict=True))
