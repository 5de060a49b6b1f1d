"""Gated DeltaNet vs full attention on the PyTorch runner: prefill and decode cost
per token of one sequence at 1k and 4k tokens of context, random weights, bfloat16.

Two Qwen3.5 models alike in every weight shape but ``layer_types``: the hybrid one (three
Gated DeltaNet layers to one full-attention layer, as Qwen3.5 ships) and the same model with
full attention in every layer. Prefill: the prompt's seconds per token (chunks of
``--prefill-chunk``); decode: seconds per output token after it. The systems alternate per
round and the table gives medians and the median of the paired ratios (this machine is
noisy).

    python benchmarks/deltanet_vs_attention.py --rounds 3 --out benchmarks/results/deltanet
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

LAYERS = 8
CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 49152,  # the SmolLM2 tokenizer's
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HYBRID = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]


def make_folders(root: Path) -> dict[str, Path]:
    """Config-only HF folders (random weights at load) sharing the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    folders = {}
    for name, types in (("hybrid", HYBRID), ("attention", ["full_attention"] * LAYERS)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**CONFIG, "layer_types": types}))
        tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


def costs(
    folder: Path, context: int, max_tokens: int, prefill_chunk: int, seed: int
) -> tuple[float, float]:
    """(prefill seconds per prompt token, decode seconds per output token), one sequence."""
    runner = TorchRunner(
        TorchLoadConfig(
            folder, num_slots=1, max_model_len=context + max_tokens + 16, load_format="dummy"
        )
    )
    config = EngineConfig(num_slots=1, max_batch_tokens=prefill_chunk, prefill_chunk=prefill_chunk)
    core = EngineCore(runner, config)
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 49000) for _ in range(context)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", prompt, params))
    prefill = decode = 0.0
    produced = 0
    while core.has_work:
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        if produced == 0:
            prefill += elapsed  # the step that samples the first token ends the prefill
        else:
            decode += elapsed
        produced += sum(len(d.token_ids) for o in outputs for d in o.deltas)
    runner.close()
    return prefill / context, decode / (produced - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--max-tokens", type=int, default=33)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/deltanet"))
    args = parser.parse_args()
    folders = make_folders(args.out / "models")
    rows = []
    for context in args.contexts:
        runs: dict[str, list[tuple[float, float]]] = {"hybrid": [], "attention": []}
        for round_ in range(args.rounds):
            order = alternate(["hybrid", "attention"], round_)
            for name in order:
                runs[name].append(
                    costs(folders[name], context, args.max_tokens, args.prefill_chunk, round_)
                )
        pairs = list(zip(runs["hybrid"], runs["attention"], strict=True))
        row = {
            "context": context,
            "hybrid_prefill_ms_per_token": 1e3 * statistics.median(p for p, _ in runs["hybrid"]),
            "attention_prefill_ms_per_token": 1e3
            * statistics.median(p for p, _ in runs["attention"]),
            "hybrid_decode_ms_per_token": 1e3 * statistics.median(d for _, d in runs["hybrid"]),
            "attention_decode_ms_per_token": 1e3
            * statistics.median(d for _, d in runs["attention"]),
            "prefill_hybrid_over_attention": statistics.median(h[0] / a[0] for h, a in pairs),
            "decode_hybrid_over_attention": statistics.median(h[1] / a[1] for h, a in pairs),
            "runs": runs,
        }
        rows.append(row)
        print(
            f"context {context}: prefill {row['hybrid_prefill_ms_per_token']:.2f} vs "
            f"{row['attention_prefill_ms_per_token']:.2f} ms/token "
            f"(hybrid/attention {row['prefill_hybrid_over_attention']:.2f}); decode "
            f"{row['hybrid_decode_ms_per_token']:.1f} vs "
            f"{row['attention_decode_ms_per_token']:.1f} ms/token "
            f"({row['decode_hybrid_over_attention']:.2f})"
        )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "config": CONFIG, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
