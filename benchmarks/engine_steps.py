"""The engine alone, no HTTP: decode throughput of a runner at several batch sizes.

Builds the runner and an ``EngineCore`` in this process, admits B sequences at once (random
prompts of ``--prompt-len`` tokens, 64 unless told; greedy, ``ignore_eos``) and steps until all
have ``--max-tokens`` tokens.
Reports decode tokens/s (prefill steps excluded) per batch size; with ``--profile`` the torch
profiler's top operators for the largest batch, and with ``--step-times`` where a decode step's
time goes (each CPU kernel and the projections timed around their Python calls: the profiler
sees neither the kernels nor, inside them, the GEMM; a model whose layers run as one call,
``model/layer_stack.py``, shows them split with ``--no-layer-stack``, the decoder between the
kernels); with ``--paired-sum`` one sequence's steps each beside a sum of the bytes it reads
(``--rounds 0`` skips the throughput runs).
Used to A/B runner changes before the server-level benchmarks (``slotserve bench runners``).

    python benchmarks/engine_steps.py --runner torch --batch-sizes 1 16 64 --max-tokens 64
    python benchmarks/engine_steps.py --model ~/.cache/slotserve/models/llama-3.2-1b-Q4_K_M.gguf \
        --batch-sizes 1 16 --max-tokens 32 [--quantization none]
    python benchmarks/engine_steps.py --model FILE --batch-sizes 1 --prompt-len 16384 \
        --max-tokens 64 --rounds 0 --paired-sum
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.source import embedded_model_path
from slotserve.runners.specs import LlamaCppSpec, TorchSpec


def build(
    runner: str,
    slots: int,
    threads: int,
    cpu_kernels: bool = True,
    max_seq_len: int = 512,
    model: Path | None = None,
    quantization: str = "auto",
) -> EngineCore:
    """An engine on ``model`` (default: the embedded model); ``max_seq_len`` and
    ``quantization`` apply to the PyTorch runner."""
    path = model or embedded_model_path()
    if runner == "torch":
        from slotserve.runners.pytorch.load.settings import TorchLoadConfig

        spec: TorchSpec | LlamaCppSpec = TorchSpec(
            TorchLoadConfig(
                path,
                num_slots=slots,
                max_model_len=max_seq_len,
                threads=threads,
                cpu_kernels=cpu_kernels,
                quantization=quantization,
            )
        )
    else:
        spec = LlamaCppSpec(
            path, num_slots=slots, ctx_size=slots * 512, max_batch_tokens=512, threads=threads
        )
    config = EngineConfig(num_slots=slots, max_batch_tokens=max(512, slots + 64))
    return EngineCore(spec(), config)


def admit(core: EngineCore, batch: int, max_tokens: int, seed: int, prompt_len: int = 64) -> None:
    """``batch`` requests at once: random ``prompt_len``-token prompts, greedy, ``ignore_eos``."""
    rng = random.Random(seed)
    vocab = core.model_info.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"r{seed}-{i}", prompt, params))


def all_decoding(core: EngineCore, batch: int) -> bool:
    """Every one of the first ``batch`` slots has produced a token (prefill behind it)."""
    slots = core.snapshot().slots
    return bool(slots) and all(s.num_output_tokens > 0 for s in slots[:batch])


def run(
    core: EngineCore,
    batch: int,
    max_tokens: int,
    seed: int,
    profile: bool = False,
    prompt_len: int = 64,
) -> dict[str, float]:
    """With ``profile``: the torch profiler's top operators over the decode steps only (the
    prompts' prefill would otherwise dominate the table)."""
    admit(core, batch, max_tokens, seed, prompt_len)
    decode_tokens, decode_seconds = 0, 0.0
    profiler = None
    while core.has_work:
        # Known before the step: the one that ends the last prompt also yields its first token.
        decoding = all_decoding(core, batch)
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        produced = sum(len(d.token_ids) for o in outputs for d in o.deltas)
        if decoding:
            decode_tokens += produced
            decode_seconds += elapsed
            if profile and profiler is None:
                import torch.profiler

                profiler = torch.profiler.profile()
                profiler.start()
    if profiler is not None:
        profiler.stop()
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table)
    return {"batch": batch, "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0}


@contextmanager
def timed_calls(calls: Sequence[tuple[type, str, str]], spent: dict[str, float]) -> Iterator[None]:
    """While it lasts, each call of ``owner.name`` (for each ``(owner, name, label)``) adds its
    seconds to ``spent[label]``; the methods are restored after."""
    originals: list[tuple[type, str, Any]] = []

    def timed(original: Any, label: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

        return wrapper

    for owner, name, label in calls:
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed(originals[-1][2], label))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def step_times(
    core: EngineCore, batch: int, max_tokens: int, prompt_len: int = 64
) -> dict[str, float]:
    """Milliseconds per decode step spent in each kernel call and in the projections, and the
    rest, over ``batch`` sequences once all of them decode."""
    from slotserve.runners.pytorch.cpu_kernels import CpuKernels
    from slotserve.runners.pytorch.model.layers import Projection

    spent: dict[str, float] = {}
    kernels = ("rms_norm", "add_rms_norm", "silu_mul", "rotary_write", "paged_attention")
    calls: list[tuple[type, str, str]] = [(CpuKernels, name, name) for name in kernels]
    calls.append((Projection, "forward", "projections"))
    admit(core, batch, max_tokens, 7, prompt_len)
    with timed_calls(calls, spent):
        while not all_decoding(core, batch):
            core.step()
        spent.clear()
        steps, started = 0, time.perf_counter()
        while core.has_work:
            core.step()
            steps += 1
        total = time.perf_counter() - started
    result = {label: 1e3 * seconds / steps for label, seconds in spent.items()}
    result["rest"] = 1e3 * (total - sum(spent.values())) / steps
    result["step"] = 1e3 * total / steps
    return {"batch": batch, **{k: round(v, 2) for k, v in result.items()}}


def weight_bytes(model: Path) -> int:
    """The bytes of a GGUF file or of an HF folder's safetensors: what one decode row reads."""
    if model.is_file():
        return model.stat().st_size
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def paired_sum(core: EngineCore, model: Path, max_tokens: int, prompt_len: int) -> dict[str, float]:
    """One sequence's decode steps, each after a float32 sum over as many bytes as the step
    reads (the weights and its context's KV): the share of the read floor a step reaches,
    measured beside the box's read rate of the moment (a shared VM's swings by 2×). The sum's
    array is numpy's, on huge pages as the runner's weights and KV pool are (and as
    ``slotserve bench``'s read floor is measured)."""
    context = prompt_len + max_tokens // 2
    step_bytes = weight_bytes(model) + context * core.model_info.kv_bytes_per_token
    block = torch.from_numpy(np.ones(step_bytes // 4, dtype=np.float32))
    admit(core, 1, max_tokens, 11, prompt_len)
    while not all_decoding(core, 1):
        core.step()
    block.sum()
    sums, steps = [], []
    while core.has_work:
        started = time.perf_counter()
        block.sum()
        sums.append(time.perf_counter() - started)
        started = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - started)
    shares = sorted(s / d for s, d in zip(sums, steps, strict=True))
    return {
        "step_gb": round(step_bytes / 1e9, 3),
        "step_ms": round(1e3 * statistics.median(steps), 2),
        "sum_gb_s": round(step_bytes / 1e9 / statistics.median(sums), 1),
        "floor_share": round(statistics.median(shares), 3),
        "floor_share_p10": round(shares[len(shares) // 10], 3),
        "floor_share_p90": round(shares[len(shares) * 9 // 10], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runner", choices=["torch", "llama.cpp"], default="torch")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="prompt tokens (a long context: 16384)"
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--step-times", action="store_true", help="torch: ms per decode step in each part"
    )
    parser.add_argument(
        "--no-cpu-kernels", action="store_true", help="torch: the plain-torch path (reference)"
    )
    parser.add_argument(
        "--paired-sum",
        action="store_true",
        help="one sequence's steps against a sum of the bytes each reads (the floor's share)",
    )
    parser.add_argument(
        "--no-layer-stack",
        action="store_true",
        help="torch: the Python decoder between the kernels, not one call (an A/B)",
    )
    parser.add_argument(
        "--quant-tiles", help="torch: where quantized batches sum (amx, none; an A/B of the tiles)"
    )
    parser.add_argument("--model", type=Path, help="a GGUF file or HF folder (default: embedded)")
    parser.add_argument("--quantization", default="auto", help="torch: as serve's flag")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    slots = max(args.batch_sizes)
    core = build(
        args.runner,
        slots,
        args.threads,
        not args.no_cpu_kernels,
        max_seq_len=max(512, args.prompt_len + args.max_tokens + 1),
        model=args.model,
        quantization=args.quantization,
    )
    if args.quant_tiles:
        kernels = core.runner.shard.model.kernels  # type: ignore[attr-defined]
        kernels.quant_tiles = kernels._m.select_quant_tiles(args.quant_tiles)
    if args.no_layer_stack:
        core.runner.shard.model.stack = None  # type: ignore[attr-defined]
    run(core, 1, 4, seed=-1)  # warm-up
    results = []
    for round_index in range(args.rounds):
        for batch in args.batch_sizes:
            seed = round_index * 1000 + batch
            result = run(core, batch, args.max_tokens, seed, prompt_len=args.prompt_len)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.profile:
        run(core, args.batch_sizes[-1], 24, seed=99, profile=True)
    if args.step_times:
        for batch in args.batch_sizes:
            times = step_times(core, batch, args.max_tokens, args.prompt_len)
            print(json.dumps(times), flush=True)
    if args.paired_sum:
        model = args.model or embedded_model_path()
        floor = paired_sum(core, model, args.max_tokens, args.prompt_len)
        print(json.dumps(floor), flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
