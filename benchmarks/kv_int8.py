"""What ``--kv-cache-dtype int8`` costs and buys on the PyTorch runner, engine alone, both KV
types in one process:

    python benchmarks/kv_int8.py accuracy [--prompts 300] [--max-tokens 32] [--model FILE]
    python benchmarks/kv_int8.py speed [--context 16384] [--max-tokens 48] [--rounds 2]

``accuracy``: real prompts (the standard library's module docstrings and source code, each cut
to 100-1,500 characters), greedy, with the bfloat16 cache, the int8 one, and for scale the
bfloat16 cache on torch's operators instead of the CPU kernels (the same model rounded
otherwise); reports against the first how many replies are the same token for token, how many
begin with the same token, where the others first part, and how far the chosen tokens'
log-probabilities move while the replies agree (the largest and the median |Δ|).

``speed``: one sequence of ``--context`` random tokens, prefilled once per type, then
``--max-tokens`` decode steps; each later round asks again (the prefix cache holds the prompt,
so only the decode runs) with the types alternated. Reports the median decode step and the KV
bytes a step reads, per type.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.source import embedded_model_path
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner

TYPES = ("auto", "int8")


def real_prompts(count: int, seed: int) -> list[str]:
    """Texts people write: module docstrings and the source of standard-library modules."""
    texts: list[str] = []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    for module in names:
        if module.startswith("_") or module in {"antigravity", "this", "idlelib", "tkinter"}:
            continue
        try:
            loaded = importlib.import_module(module)
        except Exception:  # a module this machine cannot import (no display, no library)
            continue
        if loaded.__doc__ and len(loaded.__doc__) > 100:
            texts.append(loaded.__doc__.strip())
        source = getattr(loaded, "__file__", None)
        if source and source.endswith(".py"):
            texts.append(Path(source).read_text(errors="replace"))
    rng = random.Random(seed)
    rng.shuffle(texts)
    cut = []
    for text in texts[:count]:
        start = rng.randrange(max(1, len(text) - 1500))
        cut.append(text[start : start + rng.randrange(100, 1500)])
    return cut


def runner(
    model: Path, kv: str, slots: int, max_model_len: int, cpu_kernels: bool = True
) -> TorchRunner:
    return TorchRunner(
        TorchLoadConfig(
            model,
            num_slots=slots,
            max_model_len=max_model_len,
            kv_cache_dtype=kv,
            cpu_kernels=cpu_kernels,
        )
    )


def replies(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[Any]]:
    """Each prompt's greedy (token, logprob) pairs, a few prompts in flight at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out: dict[str, list[Any]] = {}
    for i, prompt in enumerate(prompts):
        out[str(i)] = []
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.has_work:
        for step in core.step():
            assert step.error is None, step.error
            for delta in step.deltas:
                assert delta.logprobs is not None
                out[step.request_id].extend((t.token_id, t.logprob) for t in delta.logprobs)
    return [out[str(i)] for i in range(len(prompts))]


# The reference, then what is held against it: (KV type, CPU kernels).
ACCURACY_RUNS = {"bf16": ("auto", True), "int8": ("int8", True), "bf16-torch-ops": ("auto", False)}


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    texts = real_prompts(args.prompts, seed=1)
    results = {}
    for name, (kv, kernels) in ACCURACY_RUNS.items():
        served = runner(args.model, kv, 16, 8192, kernels)
        prompts = [served.tokenizer.encode(text) for text in texts]
        prompts = [p for p in prompts if len(p) >= 8]  # a cut of mostly blank lines
        core = EngineCore(served, EngineConfig(num_slots=16, prefix_cache=False))
        results[name] = replies(core, prompts, args.max_tokens)
        served.close()
    return {name: compared(results["bf16"], results[name]) for name in list(ACCURACY_RUNS)[1:]}


def compared(reference: list[list[Any]], other: list[list[Any]]) -> dict[str, Any]:
    same, first, parted, deltas = 0, 0, [], []
    for base, reply in zip(reference, other, strict=True):
        tokens = [t for t, _ in base], [t for t, _ in reply]
        same += tokens[0] == tokens[1]
        first += tokens[0][0] == tokens[1][0]
        pairs = enumerate(zip(*tokens, strict=True))
        agree = next((i for i, (a, b) in pairs if a != b), len(tokens[0]))
        if agree < len(tokens[0]):
            parted.append(agree)
        deltas += [abs(base[i][1] - reply[i][1]) for i in range(agree)]
    return {
        "prompts": len(reference),
        "tokens": len(reference[0]),
        "same_reply": same,
        "same_first_token": first,
        "first_difference_median": statistics.median(parted) if parted else None,
        "logprob_delta_max": max(deltas),
        "logprob_delta_median": statistics.median(deltas),
    }


def speed(args: argparse.Namespace) -> dict[str, Any]:
    length = args.context + args.max_tokens + 64
    served = {kv: runner(args.model, kv, 1, length) for kv in TYPES}
    cores = {kv: EngineCore(r, EngineConfig(num_slots=1)) for kv, r in served.items()}
    vocab = served["auto"].model_info.vocab_size
    prompt = [random.Random(2).randrange(100, vocab - 100) for _ in range(args.context)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    steps: dict[str, list[float]] = {kv: [] for kv in TYPES}
    for round_index in range(args.rounds):
        for kv in TYPES if round_index % 2 == 0 else TYPES[::-1]:
            core = cores[kv]
            core.add_request(EngineCoreRequest(f"{kv}-{round_index}", prompt, params))
            produced = 0
            while core.has_work:
                started = time.perf_counter()
                outputs = core.step()
                elapsed = time.perf_counter() - started
                new = sum(len(d.token_ids) for o in outputs for d in o.deltas)
                if produced and new:  # a decode step (the first token ends the prefill)
                    steps[kv].append(elapsed)
                produced += new
            print(kv, "round", round_index, "done", flush=True)
    return {
        kv: {
            "decode_step_ms": round(1e3 * statistics.median(steps[kv]), 2),
            "kv_bytes_per_step": served[kv].model_info.kv_bytes_per_token * args.context,
        }
        for kv in TYPES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["accuracy", "speed"])
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.model = args.model or embedded_model_path()
    result = accuracy(args) if args.what == "accuracy" else speed(args)
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
