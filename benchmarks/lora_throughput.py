"""What LoRA adapters cost the PyTorch runner, engine alone: ``--requests`` concurrent greedy
requests (random prompts of ``--input-len`` tokens, ``--max-tokens`` out) on the base model,
then spread over ``--adapters`` random PEFT adapters of rank ``--rank`` on the ``--targets``
projections, alternating per round. The figure is output tokens per second from the first
submission to the last token; the ratio is adapters ÷ base per round, median over rounds.

    python benchmarks/lora_throughput.py --rounds 3 --output benchmarks/latest/lora/all-r16.json
    python benchmarks/lora_throughput.py --rank 8 --targets q_proj k_proj v_proj o_proj \
        --rounds 3 --output benchmarks/latest/lora/attention-r8.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cpu_limits import cpu_identity

from slotserve.bench.ab import alternate
from slotserve.bench.hf_reference import convert_gguf_to_hf
from slotserve.bench.lora_adapters import ALL_TARGETS, random_adapter
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.source import resolve_model_path
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner


def throughput(runner: TorchRunner, prompts: list[list[int]], ids: list[int], out: int) -> float:
    core = EngineCore(runner, EngineConfig(num_slots=len(prompts), prefix_cache=False))
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        adapter = ids[index % len(ids)] if ids else 0
        core.add_request(EngineCoreRequest(f"r{index}", prompt, params, adapter=adapter))
    tokens = 0
    while core.has_work:
        tokens += sum(len(d.token_ids) for o in core.step() for d in o.deltas)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(ALL_TARGETS))
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        base = convert_gguf_to_hf(resolve_model_path(None), root / "base")
        folders = [
            random_adapter(
                base, root / f"a{i}", seed=i, rank=args.rank, targets=tuple(args.targets)
            )
            for i in range(args.adapters)
        ]
        modules = tuple((f"a{i}", str(folder)) for i, folder in enumerate(folders))
        load = TorchLoadConfig(
            base, num_slots=args.requests, max_model_len=512, lora_modules=modules
        )
        runner = TorchRunner(load)
        ids = [adapter.adapter_id for adapter in runner.model_info.adapters]
        rng = random.Random(0)
        vocab = runner.model_info.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.requests)
        ]
        throughput(runner, prompts[:2], [], 4)  # warm-up
        rounds = []
        for index in range(args.rounds):
            order = alternate(("base", "lora"), index)
            figures = {
                name: throughput(runner, prompts, ids if name == "lora" else [], args.max_tokens)
                for name in order
            }
            figures["ratio"] = figures["lora"] / figures["base"]
            rounds.append(figures)
            print(f"round {index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
        runner.close()
    result = {
        "cpu": cpu_identity(),
        "torch_threads": torch.get_num_threads(),
        "settings": vars(args) | {"output": str(args.output)},
        "rounds": rounds,
        "base_tok_s": statistics.median(r["base"] for r in rounds),
        "lora_tok_s": statistics.median(r["lora"] for r in rounds),
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
