"""The PyTorch runner's throughput, engine alone (no HTTP), with random weights of a real model
configuration: batched decode, nano-vllm's benchmark workload (optionally beside transformers'
continuous batching), and one cold long prefill with the GPU's busy fraction.

    python benchmarks/gpu_throughput.py MODEL_DIR decode [--sequences 64] [--input-len 64]
        [--output-len 128]
    python benchmarks/gpu_throughput.py MODEL_DIR nano [--sequences 256] [--max-len 1024] [--hf]
    python benchmarks/gpu_throughput.py MODEL_DIR prefill [--input-len 6000]

``MODEL_DIR`` needs only ``config.json`` and tokenizer files (``--load-format dummy``). Common
options (``--help``): device (cuda; cpu for smoke tests), dtype, attention backend, batch
invariance, eager decode, slots, batch tokens, KV bytes (``--kv-memory 0``: the runner's own
share of the GPU), ``--json PATH`` (appends one JSON line per run). Each run prints a one-line
summary last.

decode: ``--sequences`` prompts of ``--input-len`` random token ids, each ``--output-len`` greedy
tokens (``ignore_eos``), after a warm-up of a few sequences, so CUDA's context, Triton's
compilation and the decode graphs' capture stay out of the figures. Output tokens per wall
second, the engine's steps, and the median of the steps in which every sequence decoded.

nano: nano-vllm's ``bench.py``: the same ``random`` draws from seed 0 (each prompt's length in
100..``--max-len``, then its token ids in 0..10000; then each request's output length in
100..``--max-len``), per-request ``max_tokens``, ``ignore_eos``; greedy here where nano-vllm
samples at temperature 0.6. Total output tokens per wall second. ``--hf``: the same prompts and
output lengths through transformers' continuous batching in this process, on
``AutoModelForCausalLM.from_config`` (random weights made on the device, after our runner is
freed). ``generate_batch`` takes one ``max_new_tokens`` for all its prompts, so the requests go to
its ``ContinuousBatchingManager`` instead (``continuous_batching_context_manager``, which
captures HF's CUDA graphs first), one ``add_request(ids, max_new_tokens=n, eos_token_id=-1)``
each: per-request lengths, no end-of-sequence token, as ours; HF's own defaults otherwise.
Two short warm-up requests run through each engine before its timed run.

prefill: one cold prompt of ``--input-len`` random tokens, one output token, prefix cache off,
after two 600-token warm-ups: its wall time; then a second cold prompt under ``torch.profiler``
(CPU and CUDA activities): GPU busy = the union of the CUDA kernel and copy intervals (overlaps
counted once) over the profiled prefill's wall time, which the profiler lengthens a little (the
same union over the unprofiled wall time is printed too).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import DeviceType

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner

Jobs = dict[str, tuple[list[int], SamplingParams]]
Figures = dict[str, Any]


@dataclasses.dataclass
class Run:
    tokens: int  # output tokens generated
    seconds: float  # wall time, first submission to last token
    steps: int
    decode_steps: list[float]  # seconds of the steps in which every sequence decoded


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", type=Path, help="folder with config.json and a tokenizer")
    parser.add_argument("workload", choices=["decode", "nano", "prefill"])
    parser.add_argument("--sequences", type=int, help="default: decode 64, nano 256")
    parser.add_argument("--input-len", type=int, help="default: decode 64, prefill 6000")
    parser.add_argument("--output-len", type=int, default=128, help="decode")
    parser.add_argument("--max-len", type=int, default=1024, help="nano: longest draw")
    parser.add_argument("--warmup-sequences", type=int, default=8, help="decode")
    parser.add_argument("--hf", action="store_true", help="nano: also transformers' CB")
    parser.add_argument("--hf-attn", help="nano --hf: attn_implementation of the HF model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-slots", type=int)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--prefill-chunk", type=int)
    parser.add_argument("--kv-memory", type=int, help="bytes; 0: the runner's default")
    parser.add_argument("--json", type=Path, help="append one JSON line per run")
    args = parser.parse_args()
    defaults = {"decode": (64, 64), "nano": (256, 0), "prefill": (1, 6000)}[args.workload]
    args.sequences = args.sequences or defaults[0]
    args.input_len = args.input_len or defaults[1]
    if args.kv_memory is None:
        args.kv_memory = (8 if args.device.startswith("cuda") else 1) * 2**30
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(
    args: argparse.Namespace, max_seq_len: int, slots: int, prefix_cache: bool = True
) -> tuple[TorchRunner, EngineCore]:
    """The runner and an engine over it."""
    load = TorchLoadConfig(
        args.model,
        num_slots=slots,
        max_batch_tokens=args.max_batch_tokens,
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        max_model_len=max_seq_len,
        kv_memory=args.kv_memory,
        attention_backend=args.attention_backend,
        batch_invariant=args.batch_invariant,
        enforce_eager=args.enforce_eager,
    )
    runner = TorchRunner(load)
    engine: dict[str, Any] = {"num_slots": slots, "max_batch_tokens": args.max_batch_tokens}
    if args.prefill_chunk:
        engine["prefill_chunk"] = args.prefill_chunk
    core = EngineCore(runner, EngineConfig(prefix_cache=prefix_cache, **engine))
    return runner, core


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


def run_jobs(core: EngineCore, jobs: Jobs, device: str) -> Run:
    """Submits every job at once and steps the engine until all finish."""
    sync(device)
    started = time.perf_counter()
    for rid, (prompt, params) in jobs.items():
        core.add_request(EngineCoreRequest(rid, prompt, params))
    tokens = steps = 0
    decode_steps: list[float] = []
    batch = min(len(jobs), core.config.num_slots)  # sequences a full decode step carries
    while core.has_work:
        prompt_before = core.counters.prompt_computed_tokens
        step_started = time.perf_counter()
        outputs = core.step()
        sync(device)
        elapsed = time.perf_counter() - step_started
        emitted = 0
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            count = sum(len(delta.token_ids) for delta in out.deltas)
            tokens += count
            emitted += count > 0
        steps += 1
        if emitted == batch and core.counters.prompt_computed_tokens == prompt_before:
            decode_steps.append(elapsed)
    return Run(tokens, time.perf_counter() - started, steps, decode_steps)


def release(device: str) -> None:
    """Gives a closed runner's leftovers back, once nothing refers to its engine."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_figures(run: Run) -> Figures:
    tok_s = run.tokens / run.seconds
    rate = f"{run.tokens} tok in {run.seconds:.2f} s = {tok_s:.0f} tok/s"
    return {"output_tokens": run.tokens, "seconds": run.seconds, "tok_s": tok_s, "rate": rate}


def decode_workload(args: argparse.Namespace) -> Figures:
    n, length = args.sequences, args.input_len
    runner, core = build(args, length + args.output_len, args.num_slots or min(n, 256))
    vocab, rng = runner.config.vocab_size, random.Random(0)
    warm = min(n, args.warmup_sequences)
    jobs = {f"warm-{i}": (random_prompt(rng, length, vocab), greedy(8)) for i in range(warm)}
    run_jobs(core, jobs, args.device)
    jobs = {f"r{i}": (random_prompt(rng, length, vocab), greedy(args.output_len)) for i in range(n)}
    before = runner.forward_seconds
    run = run_jobs(core, jobs, args.device)
    # The rest of the wall time is the engine's own (scheduling, outputs) and this loop's.
    runner_share = (runner.forward_seconds - before) / run.seconds
    runner.close()
    median = statistics.median(run.decode_steps) * 1000 if run.decode_steps else None
    figures = run_figures(run) | {"steps": run.steps, "full_decode_steps": len(run.decode_steps)}
    figures["median_decode_step_ms"] = median
    figures["runner_share"] = runner_share
    figures["summary"] = (
        f"{n}×({length}→{args.output_len}): {figures['rate']}, {run.steps} steps, median of "
        f"{len(run.decode_steps)} all-decode steps {median or float('nan'):.2f} ms, "
        f"runner {runner_share:.0%} of the wall time"
    )
    return figures


def nano_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """nano-vllm's draws, in its order: every prompt (length, then ids), then every output
    length. ``--max-len`` below 400 lowers the bottom of the range too (smoke tests)."""
    rng, top = random.Random(0), min(10000, vocab - 1)  # nano-vllm's ids: 0..10000
    low = min(100, max(1, args.max_len // 4))
    prompts = [
        [rng.randint(0, top) for _ in range(rng.randint(low, args.max_len))]
        for _ in range(args.sequences)
    ]
    return [(prompt, rng.randint(low, args.max_len)) for prompt in prompts]


def nano_ours(args: argparse.Namespace) -> tuple[list[tuple[list[int], int]], Figures]:
    """The requests, and our engine's figures on them."""
    runner, core = build(args, 2 * args.max_len, args.num_slots or min(args.sequences, 256))
    requests = nano_requests(args, runner.config.vocab_size)
    warm = {f"warm-{i}": (requests[i][0][:100], greedy(16)) for i in range(min(2, len(requests)))}
    run_jobs(core, warm, args.device)
    jobs = {f"r{i}": (prompt, greedy(out)) for i, (prompt, out) in enumerate(requests)}
    run = run_jobs(core, jobs, args.device)
    runner.close()
    needed = sum(len(prompt) + out for prompt, out in requests)
    kv = {"steps": run.steps, "kv_capacity_tokens": runner.model_info.kv_capacity}
    return requests, run_figures(run) | kv | {"workload_tokens": needed}  # prompts + outputs


def nano_workload(args: argparse.Namespace) -> Figures:
    requests, figures = nano_ours(args)
    release(args.device)  # before HF's model: the engine went out of scope with nano_ours
    ours = figures["tok_s"]
    summary = f"{args.sequences} requests, {figures['rate']} (KV holds "
    summary += f"{figures['kv_capacity_tokens']} tokens, all requests {figures['workload_tokens']})"
    if args.hf:
        hf = figures["hf"] = hf_continuous_batching(args, requests)
        figures["ours_over_hf"] = ours / hf["tok_s"]
        summary += f"; HF CB ({hf['attn_implementation']}) {hf['rate']}"
        summary += f", ours/HF {ours / hf['tok_s']:.2f}"
    figures["summary"] = summary
    return figures


def hf_continuous_batching(
    args: argparse.Namespace, requests: list[tuple[list[int], int]]
) -> Figures:
    """transformers' continuous batching on the same requests (see the module docstring)."""
    import transformers
    from transformers.generation.continuous_batching import utils as cb_utils

    hf: Any = transformers  # its annotations do not type-check
    config = hf.AutoConfig.from_pretrained(args.model)
    settings: dict[str, Any] = {"dtype": getattr(torch, args.dtype)}
    if args.hf_attn:
        settings["attn_implementation"] = args.hf_attn
    with torch.device(args.device):  # random weights made in place, not on the host first
        model = hf.AutoModelForCausalLM.from_config(config, **settings).eval()
    longest = max(out for _, out in requests)
    generation = hf.GenerationConfig(
        do_sample=False, max_new_tokens=longest, eos_token_id=config.eos_token_id
    )
    cb_config = hf.ContinuousBatchingConfig()
    if not args.device.startswith("cuda"):  # else HF sizes its KV to most of the host's RAM
        cb_config.num_blocks = sum(-(-(len(p) + n) // 256) + 1 for p, n in requests)
    hints = cb_utils.WorkloadHints(max(len(p) for p, _ in requests), longest, len(requests))
    session = model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=cb_config,
        workload_hints=hints,
        timeout=60,
    )
    with torch.no_grad(), session as manager:
        hf_collect(manager, [(p[:100], 16) for p, _ in requests[:2]], "warm-")
        sync(args.device)
        started = time.perf_counter()
        tokens = hf_collect(manager, requests, "r")
        sync(args.device)
        seconds = time.perf_counter() - started
    attention = str(model.config._attn_implementation)  # after HF's switch to a CB-friendly one
    return run_figures(Run(tokens, seconds, 0, [])) | {"attn_implementation": attention}


def hf_collect(manager: Any, requests: list[tuple[list[int], int]], prefix: str) -> int:
    """Adds the requests to HF's running manager; waits for all, returns tokens generated."""
    for i, (prompt, out) in enumerate(requests):
        # eos_token_id=-1: no end-of-sequence token, every request runs to its length.
        rid = manager.add_request(prompt, f"{prefix}{i}", max_new_tokens=out, eos_token_id=-1)
        if rid is None:
            raise RuntimeError("transformers' manager refused a request")
    tokens = done = 0
    while done < len(requests):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"HF {result.request_id}: {result.error}")
            done += 1
            tokens += len(result.generated_tokens)
    return tokens


def kernel_union_seconds(profile: Any) -> tuple[float, float, int]:
    """Kernels, copies and memsets in the profile: (union of their intervals, their sum, their
    count). GPU-side annotations span many kernels and the gaps between them: left out."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profile.events()
        if event.device_type == DeviceType.CUDA
        and not getattr(event, "is_user_annotation", False)
        and "annotation" not in str(getattr(event, "activity_type", None))
    )
    union = total = 0.0
    reached = float("-inf")
    for start, end in spans:
        total += end - start
        union += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return union / 1e6, total / 1e6, len(spans)


def prefill_workload(args: argparse.Namespace) -> Figures:
    length = args.input_len
    runner, core = build(args, max(length, 600) + 8, args.num_slots or 2, prefix_cache=False)
    vocab, rng = runner.config.vocab_size, random.Random(0)
    for i in range(2):
        run_jobs(core, {f"warm-{i}": (random_prompt(rng, 600, vocab), greedy(1))}, args.device)
    cold = run_jobs(core, {"cold": (random_prompt(rng, length, vocab), greedy(1))}, args.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prompt = random_prompt(rng, length, vocab)
    with torch.profiler.profile(activities=activities) as profile:
        profiled = run_jobs(core, {"profiled": (prompt, greedy(1))}, args.device)
    runner.close()
    union, total, kernels = kernel_union_seconds(profile)
    busy = union / profiled.seconds
    return {
        "seconds": cold.seconds,
        "steps": cold.steps,
        "prefill_tok_s": length / cold.seconds,
        "profiled_seconds": profiled.seconds,
        "device_ops": kernels,
        "device_union_seconds": union,
        "device_sum_seconds": total,
        "gpu_busy_fraction": busy,
        "gpu_busy_of_unprofiled_wall": union / cold.seconds,
        "summary": f"{length} tokens cold: {cold.seconds * 1000:.1f} ms in {cold.steps} steps "
        f"({length / cold.seconds:.0f} tok/s); profiled {profiled.seconds * 1000:.1f} ms, GPU "
        f"busy {busy:.1%} (union of {kernels} kernel/copy intervals; sum {total * 1000:.1f} ms"
        f", union over unprofiled wall {union / cold.seconds:.1%})",
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def write_json(args: argparse.Namespace, figures: Figures) -> None:
    record = {
        "workload": args.workload,
        "model": str(args.model),
        "device": args.device,
        "device_name": device_name(args.device),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "figures": figures,
    }
    with args.json.open("a") as file:
        file.write(json.dumps(record) + "\n")


def main() -> None:
    args = parse_args()
    workloads = {"decode": decode_workload, "nano": nano_workload, "prefill": prefill_workload}
    figures = workloads[args.workload](args)
    if args.json:
        write_json(args, figures)
    eager = " eager" if args.enforce_eager else ""
    invariant = " batch-invariant" if args.batch_invariant else ""
    print(
        f"[{args.workload}] {args.model.name} on {device_name(args.device)} {args.dtype} "
        f"attn={args.attention_backend}{eager}{invariant} slots={args.num_slots or 'auto'} "
        f"mbt={args.max_batch_tokens}: {figures['summary']}"
    )


if __name__ == "__main__":
    main()
