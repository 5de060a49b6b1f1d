"""Gemma 3's images on the PyTorch runner: SigLIP and the projector, and image tokens that see
their whole image (transformers' ``token_type_ids`` mask), give transformers' own greedy
tokens; no prompt chunk ends inside an image; image and text requests batched give each its
solo tokens; the server writes an image out as transformers' processor does."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.bench.vision_model import gemma3_vl_folder, picture
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.images import ImageInput
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.runner.engine_runs import alone_then_together, generate, greedy
from tests.runner.image_chats import ask_twice, image_question

SIZES = [(64, 48, 1), (100, 60, 2), (40, 90, 3)]  # width, height, seed


@pytest.fixture(scope="module")
def folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma3_vl_folder(hf_checkpoint, tmp_path_factory.mktemp("gemma3-vl"))


def _runner(path: Path, dtype: str = "float32") -> TorchRunner:
    return TorchRunner(TorchLoadConfig(path, num_slots=4, max_model_len=512, dtype=dtype))


def _image(runner: TorchRunner, width: int, height: int, seed: int) -> ImageInput:
    from PIL import Image

    preparer = runner.tokenizer.image_preparer
    assert preparer is not None
    return preparer.prepare(Image.open(io.BytesIO(picture(width, height, seed))).convert("RGB"))


def _prompt(
    runner: TorchRunner, texts: Sequence[str], images: Sequence[ImageInput]
) -> tuple[list[int], list[ImageInput]]:
    """``texts[0]``, image 0, ``texts[1]``, ... as ChatML, each image written out as
    transformers' processor writes it, and the images placed on their soft tokens."""
    preparer: Any = runner.tokenizer.image_preparer
    text = "<|im_start|>user\n"
    for i, part in enumerate(texts):
        text += part + ("<start_of_image>" if i < len(images) else "")
    text += "<|im_end|>\n<|im_start|>assistant\n"
    tokens = runner.tokenizer.encode(preparer.expand_text(text), False)
    soft = preparer.image_token_id
    starts = [i for i, t in enumerate(tokens) if t == soft and tokens[i - 1] != soft]
    placed = [dataclasses.replace(im, offset=at) for im, at in zip(images, starts, strict=True)]
    assert all(tokens[p.offset : p.end] == [soft] * p.length for p in placed)
    return tokens, placed


def _transformers_greedy(
    folder: Path, tokens: list[int], images: Sequence[ImageInput], n: int
) -> list[int]:
    from transformers import Gemma3ForConditionalGeneration

    model: Any = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.tensor([tokens])
    pixels = torch.cat(
        [torch.frombuffer(bytearray(i.pixels), dtype=torch.float32).view(i.shape) for i in images]
    )
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels,
            token_type_ids=(ids == model.config.image_token_id).long(),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(tokens) :]]


@pytest.fixture(scope="module")
def runner(folder: Path) -> Iterator[TorchRunner]:
    runner = _runner(folder)
    yield runner
    runner.close()


def test_greedy_tokens_match_transformers_generate_on_images(
    runner: TorchRunner, folder: Path
) -> None:
    assert runner.model_info.accepts_images and runner.model_info.whole_images
    shots = [_image(runner, *size) for size in SIZES]
    cases = [
        (["Describe this:"], [shots[0]]),
        (["Compare", "with", "please."], [shots[1], shots[2]]),
        # Past the sliding window before the image; 24-token chunks would cut it.
        (["A long text before the picture " * 3, "and after it."], [shots[2]]),
    ]
    core = EngineCore(runner, EngineConfig(num_slots=4, prefill_chunk=24))
    for k, (texts, images) in enumerate(cases):
        tokens, placed = _prompt(runner, texts, images)
        ours = generate(core, {f"r{k}": (tokens, greedy(12))}, images={f"r{k}": placed})
        assert ours[f"r{k}"] == _transformers_greedy(folder, tokens, placed, 12), texts


def test_an_image_longer_than_a_chunk_is_refused(runner: TorchRunner) -> None:
    tokens, placed = _prompt(runner, ["Look:"], [_image(runner, 64, 48, 1)])
    core = EngineCore(runner, EngineConfig(num_slots=4, prefill_chunk=8))
    with pytest.raises(InvalidRequestError, match="computed in one prompt chunk"):
        core.validate(EngineCoreRequest("r", tokens, greedy(4), images=tuple(placed)))


def test_image_and_text_requests_batched_give_their_solo_tokens(folder: Path) -> None:
    runner = _runner(folder, dtype="bfloat16")
    try:
        shots = [_image(runner, *size) for size in SIZES]
        prompts = [
            _prompt(runner, ["Look:"], [shots[0]]),
            _prompt(runner, ["Just text, no picture at all."], []),
            _prompt(runner, ["One", "two"], [shots[1], shots[2]]),
        ]
        core = EngineCore(runner, EngineConfig(num_slots=4, max_batch_tokens=40))
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


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.conftest import start_server, stop_server

    server = start_server(
        tmp_path_factory.mktemp("gemma3-server"),
        str(folder),
        "--runner", "torch", "--dtype", "float32", "--slots", "4",
        "--served-model-name", "x",
    )  # fmt: skip
    yield server
    stop_server(server)


def test_a_chat_image_is_written_out_and_served_from_the_cache(
    server: Any, runner: TorchRunner, folder: Path
) -> None:
    import base64

    import httpx
    import openai

    png = picture(100, 60, 2)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = image_question(url)
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    first, cached = ask_twice(client, messages)
    assert cached > 16  # the image's KV reused
    tokens, placed = _prompt(runner, ["What is in"], [_image(runner, 100, 60, 2)])
    assert first.usage.prompt_tokens == len(tokens)  # the processor's expansion, exactly
    counted = httpx.post(
        f"{server.base_url}/tokenize", json={"model": "x", "messages": messages}, timeout=30
    ).json()["count"]
    assert counted == len(tokens)
    reference = _transformers_greedy(folder, tokens, placed, 8)
    text = b"".join(runner.tokenizer.token_bytes(t) for t in reference).decode(errors="replace")
    assert first.choices[0].message.content == text
