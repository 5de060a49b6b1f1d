"""What images cost a server and what its caches give back, on a Qwen2.5-VL of real vision
shape (the 32-block tower every Qwen2.5-VL ships, random weights) beside SmolLM2-135M's
decoder, PyTorch runner:

* **Repeated image:** time to first token (streamed chat) of a request with an image never
  seen, then of the same request again (prefix cache: the image's KV; encoder cache), then of
  the same image with another question after it. Ratios: cold ÷ repeat.
* **Beside text streams:** ``--streams`` text streams' time per output token, alone, while
  image requests (a fresh image each, one after another) run beside them, and while text
  requests with as many prompt tokens run beside them instead (what any prompt of that length
  costs the streams). Ratios: with ÷ without (medians over the streams); and the time to
  first token of the requests beside them (an image's: its encode within --encoder-share).

    python benchmarks/image_serving.py --output benchmarks/latest/image-serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from cpu_limits import cpu_identity

from slotserve.bench.servers import running, slotserve_spec
from slotserve.bench.vision_model import (
    QWEN2_5_VL_VISION,
    SMOLLM2_TEXT,
    picture,
    qwen_vl_folder,
)
from slotserve.hosting.source import resolve_model_path

STORY = "Write a long story about a lighthouse keeper and the sea, with many details."


def image_message(seed: int, size: int, question: str) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(picture(size, size, seed)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


async def stream_times(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], max_tokens: int
) -> list[float]:
    """Seconds from the request to each streamed content token."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    started, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line.removeprefix("data: "))["choices"]
                if choices and choices[0]["delta"].get("content"):
                    times.append(time.perf_counter() - started)
    return times


async def repeated_image(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, list[float]] = {"cold": [], "repeat": [], "new_question": []}
    for round_ in range(args.rounds):
        seed = 1000 + round_
        asked = image_message(seed, args.image_size, "What is in this picture?")
        other = image_message(seed, args.image_size, "Which colours do you see?")
        figures["cold"].append((await stream_times(client, asked, 2))[0])
        figures["repeat"].append((await stream_times(client, asked, 2))[0])
        figures["new_question"].append((await stream_times(client, other, 2))[0])
    p50 = {name: statistics.median(values) for name, values in figures.items()}
    return {
        "ttft_s": figures,
        "ttft_p50_s": p50,
        "cold_over_repeat": p50["cold"] / p50["repeat"],
        "cold_over_new_question": p50["cold"] / p50["new_question"],
    }


async def same_length_text(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    """A text prompt as long in tokens as an image request's."""

    async def count(messages: list[dict[str, Any]]) -> int:
        reply = await client.post("/tokenize", json={"messages": messages})
        return int(reply.raise_for_status().json()["count"])

    target = await count(image_message(1, args.image_size, "Describe it."))
    words = target
    while True:
        text = "Describe it." + " apple" * words
        got = await count([{"role": "user", "content": text}])
        if abs(got - target) <= 2:
            return text
        words += target - got


async def text_tpot(
    client: httpx.AsyncClient, args: argparse.Namespace, beside: str | None, fresh: Iterator[int]
) -> dict[str, Any]:
    """The streams' TPOT while requests are sent one after another beside them: ``beside``
    "image" (a fresh image each), else that text prompt (after a fresh number: no cached
    prefix); None: none."""
    messages = [{"role": "user", "content": STORY}]
    streams = [stream_times(client, messages, args.stream_tokens) for _ in range(args.streams)]
    done = asyncio.Event()
    sent = 0
    ttfts: list[float] = []

    async def send() -> None:
        nonlocal sent
        while not done.is_set():
            if beside == "image":
                other = image_message(next(fresh), args.image_size, "Describe it.")
            else:
                other = [{"role": "user", "content": f"{next(fresh)} {beside}"}]
            ttfts.append((await stream_times(client, other, 4))[0])
            sent += 1

    sender = asyncio.create_task(send()) if beside is not None else None
    results = await asyncio.gather(*streams)
    done.set()
    if sender is not None:
        await sender
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in results]
    return {
        "tpot_s": tpots,
        "tpot_p50_s": statistics.median(tpots),
        "requests_beside": sent,
        "ttft_beside_s": ttfts,
    }


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        await stream_times(client, image_message(1, args.image_size, "Warm up."), 2)
        result: dict[str, Any] = {"repeated_image": await repeated_image(client, args)}
        text = await same_length_text(client, args)
        rounds = []
        fresh = itertools.count(5000)  # images and prompts never seen before
        for _ in range(args.tpot_rounds):  # alternating, for the box's noise
            alone = await text_tpot(client, args, None, fresh)
            images = await text_tpot(client, args, "image", fresh)
            texts = await text_tpot(client, args, text, fresh)
            rounds.append({"alone": alone, "beside_images": images, "beside_text": texts})

        def ratio(kind: str) -> float:
            return float(
                statistics.median(r[kind]["tpot_p50_s"] / r["alone"]["tpot_p50_s"] for r in rounds)
            )

        result["text_streams"] = {
            "rounds": rounds,
            "tpot_ratio_median": ratio("beside_images"),
            "tpot_ratio_same_length_text": ratio("beside_text"),
            "image_ttft_beside_p50_s": statistics.median(
                t for r in rounds for t in r["beside_images"]["ttft_beside_s"]
            ),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=24)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tpot-rounds", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=32)
    parser.add_argument("--encoder-share", type=float, help="the server's; default its own")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    vision = QWEN2_5_VL_VISION | {"depth": args.vision_depth}
    with tempfile.TemporaryDirectory() as scratch:
        folder = qwen_vl_folder(
            resolve_model_path(None),
            Path(scratch) / "qwen-vl",
            SMOLLM2_TEXT,
            vision,
            max_pixels=args.image_size**2,
            dtype="bfloat16",
        )
        share = [] if args.encoder_share is None else ["--encoder-share", str(args.encoder_share)]
        spec = slotserve_spec(folder, args.slots, 0, 1024, ["--runner", "torch", *share])
        with running(spec, Path(scratch)) as server:
            figures = asyncio.run(measure(server.spec.base_url, args))
    result = {
        "cpu": cpu_identity(),
        "settings": vars(args) | {"output": str(args.output)},
        **figures,
    }
    summary = {
        "cold_over_repeat": figures["repeated_image"]["cold_over_repeat"],
        "cold_over_new_question": figures["repeated_image"]["cold_over_new_question"],
        "ttft_p50_s": figures["repeated_image"]["ttft_p50_s"],
        "tpot_ratio_median": figures["text_streams"]["tpot_ratio_median"],
        "tpot_ratio_same_length_text": figures["text_streams"]["tpot_ratio_same_length_text"],
        "image_ttft_beside_p50_s": figures["text_streams"]["image_ttft_beside_p50_s"],
    }
    print(json.dumps({"cpu": result["cpu"], **summary}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
