"""Where a cold prompt's prefill time goes, engine alone (no HTTP): each step's time, then the
torch profiler's top operators for a second cold prompt of the same length.

    python benchmarks/prefill_profile.py MODEL_DIR [--prompt-len 6000] [--device cuda]

``MODEL_DIR`` needs only a ``config.json`` and a tokenizer: the weights are random
(``--load-format dummy``). Two short prompts run first, so start-up costs (CUDA's context,
kernel selection) stay out of the figures. Random token ids, greedy, one output token, the
prefix cache off.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner


def prefill_steps(core: EngineCore, prompt: list[int], name: str, device: str) -> list[float]:
    """Seconds of each step until the prompt's first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest(name, prompt, params))
    steps = []
    while core.scheduler.has_work:
        started = time.perf_counter()
        core.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - started)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt-len", type=int, default=6000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=22, help="operators in the profile table")
    args = parser.parse_args()
    load = TorchLoadConfig(
        args.model,
        num_slots=2,
        max_model_len=max(args.prompt_len, 600) + 64,
        load_format="dummy",
        device=args.device,
        kv_memory=4 * 2**30,
    )
    runner = TorchRunner(load)
    core = EngineCore(runner, EngineConfig(num_slots=2, prefix_cache=False))
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, runner.config.vocab_size) for _ in range(length)]

    for i in range(2):
        prefill_steps(core, prompt(600), f"warm-{i}", args.device)
    steps = prefill_steps(core, prompt(args.prompt_len), "cold", args.device)
    print(f"{args.model.name}, {args.prompt_len} tokens: {sum(steps):.3f} s in {len(steps)} steps")
    print("steps (ms):", [round(s * 1000, 1) for s in steps])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        steps = prefill_steps(core, prompt(args.prompt_len), "profiled", args.device)
    print(f"profiled: {sum(steps):.3f} s")
    table = profile.key_averages().table(
        sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60
    )
    print(table)
    runner.close()


if __name__ == "__main__":
    main()
