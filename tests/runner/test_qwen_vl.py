"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL MoE on the PyTorch runner: images through the vision
tower, M-RoPE (and Qwen3-VL's deepstack features) give transformers' own greedy tokens; the
prefix cache shares KV over the same image only; image and text requests batched give each
its solo tokens; the openai and anthropic clients send images to a real server."""

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
def vl_folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_vl_folder(hf_checkpoint, tmp_path_factory.mktemp("qwen-vl"))


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


@pytest.fixture(scope="module")
def vl_server(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.conftest import start_server, stop_server

    media = tmp_path_factory.mktemp("media")
    (media / "shot.png").write_bytes(picture(64, 48, 1))
    server = start_server(
        tmp_path_factory.mktemp("vl-server"),
        str(vl_folder),
        "--runner", "torch", "--dtype", "float32", "--slots", "4",
        "--served-model-name", "x",
        "--limit-mm-per-prompt", '{"image": 3}', "--allowed-local-media-path", str(media),
        "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "1",
    )  # fmt: skip
    server.media = media  # type: ignore[attr-defined]
    yield server
    stop_server(server)


def _data_url(png: bytes, kind: str = "png") -> str:
    import base64

    if kind == "jpeg":
        from PIL import Image

        out = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").save(out, format="JPEG")
        png = out.getvalue()
    return f"data:image/{kind};base64,{base64.b64encode(png).decode()}"


def test_openai_and_anthropic_clients_send_images_end_to_end(vl_server: Any) -> None:
    import anthropic
    import httpx
    import openai

    client = openai.OpenAI(base_url=vl_server.api_url, api_key="unused", max_retries=0)
    png = picture(100, 60, 2)
    content: Any = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
    ]
    messages: Any = [{"role": "user", "content": content}]
    first = client.chat.completions.create(
        model="x", messages=messages, max_tokens=8, temperature=0
    )
    again = client.chat.completions.create(
        model="x", messages=messages, max_tokens=8, temperature=0
    )
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 20  # the image's KV reused
    counted = httpx.post(
        f"{vl_server.base_url}/tokenize", json={"model": "x", "messages": messages}, timeout=30
    ).json()["count"]
    assert counted == first.usage.prompt_tokens > 20  # image tokens counted as they run
    model_info = httpx.get(f"{vl_server.base_url}/model_info", timeout=30).json()
    assert model_info["has_image_understanding"] is True  # what SGLang's gateway reads

    jpeg = client.chat.completions.create(
        model="x",
        messages=[
            {
                "role": "user",
                "content": [
                    content[0],
                    {"type": "image_url", "image_url": {"url": _data_url(png, "jpeg")}},
                ],
            }
        ],
        max_tokens=4,
    )
    assert jpeg.usage is not None and jpeg.usage.prompt_tokens == first.usage.prompt_tokens

    claude = anthropic.Anthropic(base_url=vl_server.base_url, api_key="unused", max_retries=0)
    block: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": _data_url(png)[22:]},
    }
    reply = claude.messages.create(
        model="x",
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in"}, block]}],
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == first.choices[0].message.content  # type: ignore[union-attr]
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == counted

    response = client.responses.create(
        model="x",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in"},
                    {"type": "input_image", "image_url": _data_url(png), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert response.output_text == first.choices[0].message.content
    assert response.usage is not None and response.usage.input_tokens == counted

    local = client.chat.completions.create(
        model="x",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": f"file://{vl_server.media}/shot.png"},
                    }
                ],
            }
        ],
        max_tokens=2,
    )
    assert local.usage is not None and local.usage.prompt_tokens > 10


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "cannot be decoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("http://169.254.169.254/latest/meta-data", "not fetched"),
        ("file:///etc/passwd", "no image file"),
        ("TRUNCATED", "cannot be decoded"),
        ("FOUR", "at most 3"),
    ],
)
def test_bad_images_are_400s_and_the_server_keeps_serving(
    vl_server: Any, url: str, words: str
) -> None:
    import httpx

    png = picture(64, 48, 4)
    parts = [{"type": "image_url", "image_url": {"url": url}}]
    if url == "TRUNCATED":
        parts = [{"type": "image_url", "image_url": {"url": _data_url(png[: len(png) // 2])}}]
    if url == "FOUR":
        parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}}] * 4
    body = {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    reply = httpx.post(f"{vl_server.api_url}/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]["message"]
    fine = {"model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert httpx.post(f"{vl_server.api_url}/chat/completions", json=fine, timeout=30).is_success


def test_image_urls_are_fetched_and_a_trickling_one_is_cut_off_while_the_server_answers(
    vl_server: Any,
) -> None:
    """Two requests, each naming three allowed URLs that trickle a byte at a time: both are
    refused within the fetch deadline (1 s) plus 2 s, while health checks and tokenization
    keep answering at once (the fetches wait on the event loop, not on the rendering threads)."""
    import concurrent.futures
    import statistics
    import time

    import httpx

    from tests.media_server import media_server

    def chat(urls: list[str]) -> httpx.Response:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        body = {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
        return httpx.post(f"{vl_server.api_url}/chat/completions", json=body, timeout=30)

    tokenize = {"model": "x", "prompt": "hello there"}
    probe = httpx.Client(base_url=vl_server.base_url, timeout=30)  # one client: no set-up timed
    with probe, media_server(picture(64, 48, 5)) as media:
        assert chat([f"{media.base_url}/picture.png"]).status_code == 200
        trickles = [f"{media.base_url}/trickle.png?{i}" for i in range(3)]
        probes: list[float] = []
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            pending = [pool.submit(chat, trickles), pool.submit(chat, trickles)]
            while not all(p.done() for p in pending):
                for method, path, body in (
                    ("GET", "/health", None),
                    ("POST", "/tokenize", tokenize),
                ):
                    began = time.monotonic()
                    answer = probe.request(method, path, json=body)
                    probes.append(time.monotonic() - began)
                    assert answer.status_code == 200
            answers = [p.result() for p in pending]
            took = time.monotonic() - started
    assert all(a.status_code == 400 for a in answers), [a.text for a in answers]
    assert all("--media-fetch-timeout" in a.json()["error"]["message"] for a in answers)
    assert took < 1 + 2
    # A fetch waiting on the loop's own thread would hold a probe for its whole 1 s deadline;
    # the worst probe is kept under that, the usual one at once (a shared VM stalls a rare
    # probe for a fraction of a second, as it stalls any process).
    assert len(probes) >= 4 and statistics.median(probes) < 0.05, probes
    assert max(probes) < 0.9, probes


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
