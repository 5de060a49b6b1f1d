"""What ``--schedule-policy priority`` buys a high-priority request on a saturated server: its
time to first token (streamed chat, ``--probes`` requests one after another) on the idle
server, then beside ``--load`` low-priority streams that keep every slot busy and a queue
waiting, then the same load with the probes at the load's own priority (what fcfs gives
them). Ratios are TTFT p50 ÷ the idle p50.

    python benchmarks/priority_ttft.py --output benchmarks/latest/priority-ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from cpu_limits import cpu_identity

from slotserve.bench.servers import running, slotserve_spec
from slotserve.hosting.source import resolve_model_path

PROBE = "Name one colour of the rainbow."
LOAD = "Write a long story about a lighthouse keeper and the sea, with many details."


async def ttft(client: httpx.AsyncClient, priority: int) -> float:
    body = {
        "messages": [{"role": "user", "content": PROBE}],
        "max_tokens": 4,
        "stream": True,
        "priority": priority,
    }
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            if choices and choices[0]["delta"].get("content"):
                return time.perf_counter() - started
    raise RuntimeError("no token streamed")


async def load_stream(client: httpx.AsyncClient, stop: asyncio.Event, max_tokens: int) -> None:
    body = {
        "messages": [{"role": "user", "content": LOAD}],
        "max_tokens": max_tokens,
        "priority": 10,
        "ignore_eos": True,
    }
    while not stop.is_set():
        (await client.post("/v1/chat/completions", json=body)).raise_for_status()


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    limits = httpx.Limits(max_connections=args.load + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await ttft(client, -10)  # warm-up
        figures: dict[str, list[float]] = {"idle": []}
        for _ in range(args.probes):
            figures["idle"].append(await ttft(client, -10))
        stop = asyncio.Event()
        streams = [
            asyncio.create_task(load_stream(client, stop, args.load_tokens))
            for _ in range(args.load)
        ]
        await asyncio.sleep(args.settle_s)  # the slots fill and a queue forms
        for name, priority in (("high", -10), ("same", 10)):
            figures[name] = []
            for _ in range(args.probes):
                figures[name].append(await ttft(client, priority))
        stop.set()
        await asyncio.gather(*streams)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--load", type=int, default=24, help="low-priority streams")
    parser.add_argument("--load-tokens", type=int, default=96)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    extra = ["--schedule-policy", "priority", "--max-queue", "256"]
    spec = slotserve_spec(resolve_model_path(None), args.slots, 0, 512, extra)
    with tempfile.TemporaryDirectory() as logs, running(spec, Path(logs)) as server:
        figures = asyncio.run(measure(server.spec.base_url, args))
    p50 = {name: statistics.median(values) for name, values in figures.items()}
    result = {
        "cpu": cpu_identity(),
        "settings": vars(args) | {"output": str(args.output)},
        "ttft_s": figures,
        "ttft_p50_s": p50,
        "high_over_idle": p50["high"] / p50["idle"],
        "same_over_idle": p50["same"] / p50["idle"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "ttft_s"}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
