"""What images cost a server and what its caches give back, on a Qwen2.5-VL of real vision
shape (the 32-block tower every Qwen2.5-VL ships, random weights) beside SmolLM2-135M's
decoder, PyTorch runner:

* **Repeated image:** time to first token (streamed chat) of a request with an image never
  seen, then of the same request again (prefix cache: the image's KV; encoder cache), then of
  the same image with another question after it. Ratios: cold ÷ repeat.
* **Beside text streams:** ``--streams`` text streams' time per output token, alone and while
  image requests (a fresh image each, one after another) run beside them. Ratio: with ÷
  without (medians over the streams).

    python benchmarks/image_serving.py --output benchmarks/latest/image-serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import time
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


async def text_tpot(
    client: httpx.AsyncClient, args: argparse.Namespace, with_images: bool
) -> dict[str, Any]:
    messages = [{"role": "user", "content": STORY}]
    streams = [stream_times(client, messages, args.stream_tokens) for _ in range(args.streams)]
    done = asyncio.Event()
    images_sent = 0

    async def send_images() -> None:
        nonlocal images_sent
        while not done.is_set():
            seed = 5000 + images_sent
            await stream_times(client, image_message(seed, args.image_size, "Describe it."), 4)
            images_sent += 1

    sender = asyncio.create_task(send_images()) if with_images else None
    results = await asyncio.gather(*streams)
    done.set()
    if sender is not None:
        await sender
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in results]
    return {"tpot_s": tpots, "tpot_p50_s": statistics.median(tpots), "images": images_sent}


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        await stream_times(client, image_message(1, args.image_size, "Warm up."), 2)
        result: dict[str, Any] = {"repeated_image": await repeated_image(client, args)}
        rounds = []
        for _ in range(args.tpot_rounds):  # alternating, for the box's noise
            alone = await text_tpot(client, args, with_images=False)
            beside = await text_tpot(client, args, with_images=True)
            rounds.append({"alone": alone, "beside_images": beside})
        ratios = [r["beside_images"]["tpot_p50_s"] / r["alone"]["tpot_p50_s"] for r in rounds]
        result["text_streams"] = {"rounds": rounds, "tpot_ratio_median": statistics.median(ratios)}
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
        spec = slotserve_spec(folder, args.slots, 0, 1024, ["--runner", "torch"])
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
    }
    print(json.dumps({"cpu": result["cpu"], **summary}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
