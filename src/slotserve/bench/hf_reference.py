"""HF transformers as a reference for the PyTorch runner: the shipped GGUF as an HF folder, and
transformers' own batched ``generate`` throughput on it (``slotserve bench runners``).

Run as ``python -m slotserve.bench.hf_reference FOLDER --batch N`` it prints one JSON line, so
the benchmark measures it in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, cast


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """transformers loads a GGUF with ``gguf_file=`` but refuses ``save_pretrained`` on it: a
    plain ``LlamaForCausalLM`` is rebuilt from the loaded weights and saved instead (its
    logits are the loaded model's, exactly). Llama-architecture GGUFs only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**settings))
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def generate_throughput(
    folder: Path, prompts: list[str], max_tokens: int, dtype: str = "bfloat16"
) -> dict[str, float]:
    """Output tokens per second of one batched greedy ``generate`` over ``prompts``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # transformers' own annotations of generate() do not type-check; treat the model as Any.
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    model.train(False)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    settings = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": None}
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, **settings)  # warm-up
        started = time.perf_counter()
        out = cast(  # greedy search returns the token ids
            torch.Tensor,
            model.generate(
                **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **settings
            ),
        )
        elapsed = time.perf_counter() - started
    generated = int((out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0])
    return {
        "output_tokens": generated,
        "seconds": elapsed,
        "output_throughput": generated / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt texts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())[: args.batch]
    print(json.dumps(generate_throughput(args.folder, prompts, args.max_tokens, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
