"""TTFT of a long agent prompt on a cold server, then after a restart on the same
``--prefix-cache-dir`` (the prefix comes back from disk).

    python benchmarks/prefix_restart.py [--prefix-len 6000] [--threads 2] [--runner torch]
        [--model PATH --load-format dummy]

Starts slotserve twice on the embedded GGUF, or on ``--model`` (with ``--load-format dummy``, a
folder holding only a config and a tokenizer, where no model package is installed): one
request per start, stopping it gracefully in between (the stop writes the cached prefixes to
the folder); prints JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from slotserve.bench.datasets import agent_prefix
from slotserve.bench.servers import running, slotserve_spec
from slotserve.hosting.source import embedded_model_path


def first_token_seconds(base_url: str, messages: list[dict[str, str]]) -> float:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            delta = json.loads(line[6:])["choices"][0]["delta"] if line[:7] == "data: {" else {}
            if delta.get("content"):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without content")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runner", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--model", type=Path, help="default: the embedded GGUF")
    parser.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto", help="torch: dummy weights"
    )
    args = parser.parse_args()
    messages = [
        {"role": "system", "content": agent_prefix(args.prefix_len)},
        {"role": "user", "content": "List the files."},
    ]
    # The PyTorch runner sizes a sequence by --max-model-len, not by --ctx-size.
    per_runner = ["--max-model-len", "16384"] if args.runner == "torch" else []
    if args.load_format != "auto":
        per_runner += ["--load-format", args.load_format]
    results: dict[str, Any] = {"runner": args.runner, "prefix_len": args.prefix_len}
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as logs:
        for run in ("cold", "after_restart"):
            spec = slotserve_spec(
                args.model or embedded_model_path(),
                slots=2,
                threads=args.threads,
                ctx_per_slot=16384,
                extra_args=["--prefix-cache-dir", folder, "--runner", args.runner, *per_runner],
            )
            with running(spec, Path(logs) / run) as server:
                results[f"{run}_ttft_s"] = first_token_seconds(server.spec.base_url, messages)
                stats = httpx.get(f"{server.spec.base_url}/v1/prefix_cache_stats", timeout=30)
                results[f"{run}_disk"] = stats.json()["tiers"]["disk"]
    results["ratio"] = results["cold_ttft_s"] / results["after_restart_ttft_s"]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
