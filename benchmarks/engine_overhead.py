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
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "Write a long story about a robot who learns to paint."
# Completions with a short prompt keep prefill negligible, so the ratio isolates the engine's
# per-step cost; --chat measures the chat route (template + system prompt: ~40 prompt tokens).
SHORT_PROMPT = "Once upon a time"


def raw_decode_rate(model: str, batch: int, tokens: int, threads: int, flash_attn: bool) -> float:
    """Tokens/s of plain batched decoding with llama.cpp (runs in its own process)."""
    import llama_cpp as llama
    import numpy as np

    from slotserve.runners.llama_cpp_runner import init_llama_backend

    init_llama_backend()  # quiet logging, as in the server
    model_params = llama.llama_model_default_params()
    m = llama.llama_model_load_from_file(model.encode(), model_params)
    params = llama.llama_context_default_params()
    params.n_ctx = batch * 1024
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = batch
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (
        llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx = llama.llama_init_from_model(m, params)
    vocab = llama.llama_model_get_vocab(m)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    buf = (llama.llama_token * 256)()
    text = SHORT_PROMPT.encode()
    n_prompt = llama.llama_tokenize(vocab, text, len(text), buf, 256, True, True)
    prompt = list(buf[:n_prompt])
    b = llama.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        assert llama.llama_decode(ctx, b) == 0

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
        return int(logits.argmax())

    last = []
    for seq in range(batch):
        decode([(t, p, seq, p == n_prompt - 1) for p, t in enumerate(prompt)])
        last.append(argmax(n_prompt - 1))
    started = time.perf_counter()
    for step in range(tokens):
        decode([(last[s], n_prompt + step, s, True) for s in range(batch)])
        last = [argmax(s) for s in range(batch)]
    elapsed = time.perf_counter() - started
    llama.llama_batch_free(b)
    llama.llama_free(ctx)
    llama.llama_model_free(m)
    return batch * tokens / elapsed


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    parser.add_argument("--raw", type=int, help=argparse.SUPPRESS)  # child mode: one raw run
    parser.add_argument("--model", help="GGUF file (default: the embedded model)")
    args = parser.parse_args()

    from slotserve.model_source import resolve_model_path

    model = str(resolve_model_path(args.model))
    if args.raw is not None:
        print(raw_decode_rate(model, args.raw, args.tokens, args.threads, args.flash_attn))
        return

    port = _free_port()
    attention_flag = "--flash-attn" if args.flash_attn else "--no-flash-attn"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "serve",
            model,
            "--port",
            str(port),
            "--slots",
            str(args.slots),
            "--threads",
            str(args.threads),
            "--log-level",
            "warning",
            attention_flag,
        ],
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base_url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        asyncio.run(server_rate(base_url, 2, 8))  # warm-up
        results: dict[int, dict[str, list[float]]] = {
            b: {"server": [], "raw": [], "ratio": []} for b in args.batch_sizes
        }
        before = httpx.get(f"{base_url}/v1/slots").json()
        for round_index in range(args.rounds):
            for batch in args.batch_sizes:
                served = asyncio.run(server_rate(base_url, batch, args.tokens, args.chat))
                raw = float(
                    subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--raw",
                            str(batch),
                            "--tokens",
                            str(args.tokens),
                            "--threads",
                            str(args.threads),
                            "--model",
                            model,
                            attention_flag,
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout.split()[-1]
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
    finally:
        server.terminate()
        server.wait()
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
