"""Qwen3-MoE vs a dense Qwen3 of the same active parameters on the PyTorch runner:
decode tokens/s at 1 and 16 streams, random weights (``--load-format dummy``), bfloat16.

Both models have the same attention; the MoE's sparse MLP runs ``top_k`` of ``experts``
experts of width ``moe_intermediate``, the dense MLP has width ``top_k * moe_intermediate``,
so each token multiplies the same number of weights. The systems alternate per round and the
table gives the median of the paired ratios (this machine is noisy).

    python benchmarks/moe_vs_dense.py --rounds 3 --out benchmarks/results/moe-vs-dense
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from slotserve.bench.ab import alternate
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.source import embedded_model_path
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner

COMMON: dict[str, Any] = {
    "vocab_size": 49152,  # the SmolLM2 tokenizer's
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_folders(root: Path, experts: int, top_k: int, width: int) -> dict[str, Path]:
    """Config-only HF folders (random weights at load) sharing the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    configs = {
        "moe": {
            **COMMON,
            "model_type": "qwen3_moe",
            "intermediate_size": top_k * width,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": width,
            "norm_topk_prob": True,
        },
        "dense": {**COMMON, "model_type": "qwen3", "intermediate_size": top_k * width},
    }
    folders = {}
    for name, config in configs.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


def decode_tok_s(folder: Path, streams: int, max_tokens: int, seed: int) -> float:
    runner = TorchRunner(
        TorchLoadConfig(folder, num_slots=streams, max_model_len=512, load_format="dummy")
    )
    core = EngineCore(runner, EngineConfig(num_slots=streams, max_batch_tokens=512))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        prompt = [rng.randrange(100, 49000) for _ in range(64)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    tokens, seconds = 0, 0.0
    while core.has_work:
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        if all(s.num_output_tokens > 0 for s in core.snapshot().slots[:streams]):  # decode steps
            tokens += sum(len(d.token_ids) for o in outputs for d in o.deltas)
            seconds += elapsed
    runner.close()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--width", type=int, default=384, help="moe_intermediate_size")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe-vs-dense"))
    args = parser.parse_args()
    folders = make_folders(args.out / "models", args.experts, args.top_k, args.width)
    rows = []
    for streams in args.streams:
        runs: dict[str, list[float]] = {"moe": [], "dense": []}
        for round_ in range(args.rounds):
            order = alternate(["moe", "dense"], round_)
            for name in order:
                runs[name].append(decode_tok_s(folders[name], streams, args.max_tokens, round_))
        ratios = [m / d for m, d in zip(runs["moe"], runs["dense"], strict=True)]
        row = {
            "streams": streams,
            "moe_tok_s": statistics.median(runs["moe"]),
            "dense_tok_s": statistics.median(runs["dense"]),
            "moe_over_dense": statistics.median(ratios),
            "runs": runs,
        }
        rows.append(row)
        print(
            f"{streams:>3} streams: MoE {row['moe_tok_s']:.1f} tok/s, dense "
            f"{row['dense_tok_s']:.1f} tok/s, MoE/dense {row['moe_over_dense']:.2f}"
        )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
