"""Prefix cache on a hybrid model (Qwen3.5: Gated DeltaNet and full attention, 3:1), random
weights: TTFT of prompts that repeat a prefix, cache on against off.

    python benchmarks/hybrid_prefix_cache.py [--prefix-len 4000] [--rounds 2] [--runner torch]
        [--tokenizer DIR]

``--runner torch`` (default): the HF config alone, weights drawn at load (``--load-format
dummy``, bfloat16). ``--runner llama.cpp``: random weights saved by transformers, written as
llama.cpp's converter writes a ``qwen35`` GGUF and quantised to Q8_0.

Per round, a server with the prefix cache on and one with it off (alternating which goes
first) serve the same sequence over ``/v1/completions`` (streamed, greedy): a conversation's
three turns (each resends the last prompt, its reply and a new message) and then a second
conversation over the same system prompt. The first prompt is cold on both; the rest repeat a
prefix. Tokens must match between the two servers. Prints JSON: medians per kind of prompt and
the ratio off ÷ on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from slotserve.bench.datasets import agent_prefix
from slotserve.bench.servers import ServerSpec, free_port, running

LAYERS = 24
# Qwen3.5's small-model shapes (hidden 1024; its Gated DeltaNet layers: 16 value heads and 16
# key heads of 128) with the SmolLM2 tokenizer's vocabulary.
CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 49152,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "layer_types": [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)
    ],
}
MESSAGES = [
    "Read the file src/app.py and tell me what it does.",
    "Now add a function that parses the configuration file.",
    "Write a test for it.",
]


def make_folder(root: Path, tokenizer_dir: Path | None = None) -> Path:
    """A config-only HF folder (random weights at load) with the SmolLM2 tokenizer: the
    embedded GGUF's, or the one saved in ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    from slotserve.hosting.source import embedded_model_path

    if tokenizer_dir is None:
        gguf = embedded_model_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    folder = root / "qwen35-shapes"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    tokenizer.save_pretrained(folder)
    return folder


def make_gguf(root: Path) -> Path:
    """The config with random weights (transformers' initialisation) as a Q8_0 ``qwen35``
    GGUF."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from slotserve.bench.hf_gguf import q8_0_gguf, qwen35_gguf
    from slotserve.hosting.source import embedded_model_path

    folder = make_folder(root)
    torch.manual_seed(0)
    settings = {k: v for k, v in CONFIG.items() if k != "model_type"}
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**settings)).save_pretrained(folder)
    full = qwen35_gguf(folder, root / "qwen35-shapes-f32.gguf", embedded_model_path())
    quantised = q8_0_gguf(full, root / "qwen35-shapes-q8_0.gguf")
    full.unlink()
    return quantised


def server_spec(model: Path, runner: str, threads: int, cache: bool) -> ServerSpec:
    port = free_port()
    sizes: tuple[str, ...] = ("--ctx-size", "16384")  # llama.cpp: 8192 per slot
    if runner == "torch":
        sizes = ("--load-format", "dummy", "--max-model-len", "8192")
    command = [
        *(sys.executable, "-m", "slotserve.cli", "serve", str(model), "--runner", runner),
        *sizes,
        *("--host", "127.0.0.1", "--port", str(port), "--slots", "2"),
        *("--threads", str(threads), "--log-level", "warning"),
        "--prefix-cache" if cache else "--no-prefix-cache",
    ]
    name = "slotserve-cache" if cache else "slotserve-no-cache"
    return ServerSpec(name, command, port, ready_path="/ready")


def complete(base_url: str, prompt: str, max_tokens: int) -> tuple[float, list[str]]:
    """Seconds to the first streamed token, and the reply's tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
    }
    started = time.perf_counter()
    first: float | None = None
    tokens: list[str] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=1800) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            got = (choice.get("logprobs") or {}).get("tokens") or []
            if got and first is None:
                first = time.perf_counter() - started
            tokens += got
    assert first is not None, "no token came back"
    return first, tokens


def play(base_url: str, system: str, max_tokens: int) -> list[tuple[str, float, list[str]]]:
    """The sequence of prompts; (kind, TTFT, tokens) each."""
    results = []
    prompt = system
    for turn, message in enumerate(MESSAGES):
        prompt += f"\nUser: {message}\nAssistant:"
        ttft, tokens = complete(base_url, prompt, max_tokens)
        results.append(("cold" if turn == 0 else "next turn", ttft, tokens))
        prompt += "".join(tokens)
    ttft, tokens = complete(base_url, system + "\nUser: List the files.\nAssistant:", max_tokens)
    results.append(("same system prompt", ttft, tokens))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runner", choices=["torch", "llama.cpp"], default="torch")
    parser.add_argument("--tokenizer", type=Path, help="torch: a saved SmolLM2 tokenizer")
    args = parser.parse_args()
    system = agent_prefix(args.prefix_len)
    ttfts: dict[tuple[bool, str], list[float]] = {}
    identical = True
    with tempfile.TemporaryDirectory() as root:
        if args.runner == "torch":
            model = make_folder(Path(root), args.tokenizer)
        else:
            model = make_gguf(Path(root))
        for round_ in range(args.rounds):
            tokens: dict[bool, list[list[str]]] = {}
            for cache in (True, False) if round_ % 2 == 0 else (False, True):
                spec = server_spec(model, args.runner, args.threads, cache)
                with running(spec, Path(root) / "logs", timeout_s=600) as server:
                    played = play(server.spec.base_url, system, args.max_tokens)
                for kind, ttft, _ in played:
                    ttfts.setdefault((cache, kind), []).append(ttft)
                tokens[cache] = [t for _, _, t in played]
            identical = identical and tokens[True] == tokens[False]
    kinds = ["cold", "next turn", "same system prompt"]
    summary: dict[str, Any] = {
        "runner": args.runner,
        "prefix_len": args.prefix_len,
        "tokens_identical": identical,
    }
    for kind in kinds:
        on, off = statistics.median(ttfts[True, kind]), statistics.median(ttfts[False, kind])
        summary[kind] = {"on_s": on, "off_s": off, "off_over_on": off / on}
    summary["all"] = {f"{'on' if c else 'off'}|{k}": v for (c, k), v in ttfts.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
