"""How close does the server get to the runner's ceiling?

Compares, at each concurrency B, the server's aggregate output tokens/s (B streaming clients,
128-token outputs with ``ignore_eos``) with the raw ``llama_decode`` rate at batch size B: one
context, one decode per step over B sequences, argmax, nothing else. The two are measured
alternately for several rounds (the machine is noisy) and the median of the paired ratios is
reported, with the share of engine step time spent outside ``llama_decode``.

    python benchmarks/engine_overhead.py --rounds 5 --batch-sizes 1 4 8 --output result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from slotserve.bench.ceiling import measure_in_subprocess
from slotserve.bench.servers import running, slotserve_spec

PROMPT = "Write a long story about a robot who learns to paint."
# Completions with a short prompt keep prefill negligible, so the ratio isolates the engine's
# per-step cost; --chat measures the chat route (template + system prompt: ~40 prompt tokens).
SHORT_PROMPT = "Once upon a time"  # the same prompt the raw measurement decodes from


async def server_rate(base_url: str, clients: int, tokens: int, chat: bool = False) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:

        async def one() -> int:
            body: dict[str, object] = {
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if chat:
                body["messages"] = [{"role": "user", "content": PROMPT}]
            else:
                body["prompt"] = SHORT_PROMPT
            route = "/v1/chat/completions" if chat else "/v1/completions"
            count = 0
            async with http.stream("POST", route, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        count = json.loads(line[6:])["usage"]["completion_tokens"]
            return count

        await http.get("/health")  # connection pool and client set up before the clock starts
        started = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    assert all(c == tokens for c in counts), counts
    return sum(counts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--chat", action="store_true", help="measure the chat route instead")
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--model", help="GGUF file (default: the embedded model)")
    args = parser.parse_args()

    from slotserve.hosting.source import resolve_model_path

    model = str(resolve_model_path(args.model))

    attention_flag = "--flash-attn" if args.flash_attn else "--no-flash-attn"
    spec = slotserve_spec(Path(model), args.slots, args.threads, 4096, [attention_flag])
    base_url = spec.base_url
    with tempfile.TemporaryDirectory() as logs, running(spec, Path(logs)):
        asyncio.run(server_rate(base_url, 2, 8))  # warm-up
        results: dict[int, dict[str, list[float]]] = {
            b: {"server": [], "raw": [], "ratio": []} for b in args.batch_sizes
        }
        before = httpx.get(f"{base_url}/v1/slots").json()
        for round_index in range(args.rounds):
            for batch in args.batch_sizes:
                served = asyncio.run(server_rate(base_url, batch, args.tokens, args.chat))
                raw = measure_in_subprocess(
                    Path(model), batch, args.tokens, args.threads, args.flash_attn
                )
                entry = results[batch]
                entry["server"].append(served)
                entry["raw"].append(raw)
                entry["ratio"].append(served / raw)
                print(
                    f"round {round_index + 1} B={batch}: server {served:.1f} tok/s, "
                    f"raw {raw:.1f} tok/s, ratio {served / raw:.3f}",
                    flush=True,
                )
        after = httpx.get(f"{base_url}/v1/slots").json()
    step = after["step_seconds"] - before["step_seconds"]
    forward = after["forward_seconds"] - before["forward_seconds"]
    summary = {
        "machine": f"{os.cpu_count()} cores",
        "tokens_per_request": args.tokens,
        "route": "chat" if args.chat else "completions (short prompt)",
        "threads": args.threads,
        "slots": args.slots,
        "flash_attn": args.flash_attn,
        "share_of_step_time_outside_llama_decode": (step - forward) / step if step else None,
        "by_batch_size": {
            str(b): {
                "server_output_tps_median": statistics.median(r["server"]),
                "raw_decode_tps_median": statistics.median(r["raw"]),
                "paired_ratio_median": statistics.median(r["ratio"]),
                "paired_ratios": r["ratio"],
            }
            for b, r in results.items()
        },
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
