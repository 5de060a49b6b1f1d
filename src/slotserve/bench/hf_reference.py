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

SHARD_BYTES = 2 << 30  # safetensors files of about 2 GiB, as HF checkpoints ship


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """``gguf_path`` as an HF folder of ``dtype`` weights: transformers reads the file's
    configuration and tokenizer; the weights stream through the PyTorch runner's own GGUF
    reader (HF names, llama.cpp's converter undone) one tensor at a time into safetensors
    shards, so no more than a shard stands in memory (transformers' GGUF loader holds the whole
    model in float32). Architectures both transformers and the runner read."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from slotserve.runners.pytorch.load.gguf_file import GgufFile

    folder, name = str(gguf_path.parent), gguf_path.name
    settings = AutoConfig.from_pretrained(folder, gguf_file=name).to_diff_dict()
    for key in ("quantization_config", "_name_or_path"):  # GGUF-reading state, not the model's
        settings.pop(key, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def write_shard() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    for tensor_name, values in GgufFile(gguf_path).tensors():
        shard[tensor_name] = values.to(getattr(torch, dtype)).contiguous()
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            write_shard()
    if shard:
        write_shard()
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    settings["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[settings["model_type"]]]
    settings["tie_word_embeddings"] = "lm_head.weight" not in weight_map
    settings["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(settings, indent=1))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
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
