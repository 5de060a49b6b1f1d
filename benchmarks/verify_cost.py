"""What verifying d drafts costs each runner, as a multiple of a plain one-sequence decode step
(``ModelInfo.verify_cost``, which the speculator's draft length is chosen by).

Per runner, one sequence holds a ``--context``-token prompt; then, ``--reps`` times per length,
a chunk of the last token plus d drafts (logits at every draft position, as a verification
has) runs alone and its KV is trimmed back. Medians per d; the fit is least squares of
``cost(d) / cost(0) - 1 = first + per_draft * d`` over d >= 1.

    python benchmarks/verify_cost.py --output benchmarks/latest/verify-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from slotserve.bench.ab import alternate
from slotserve.engine.runner_interface import Runner, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.source import embedded_model_path


def load(name: str, threads: int) -> Runner:
    model = embedded_model_path()
    if name == "llama.cpp":
        from slotserve.runners.llama_cpp.runner import LlamaCppRunner

        return LlamaCppRunner(model, 2, 4096, 512, n_threads=threads)
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig
    from slotserve.runners.pytorch.runner import TorchRunner

    return TorchRunner(TorchLoadConfig(model, num_slots=2, max_model_len=2048, threads=threads))


def step_ms(runner: Runner, context: int, drafts: int, reps: int) -> float:
    times = []
    for rep in range(reps):
        tokens = [(rep * 13 + j * 7) % 3000 + 200 for j in range(drafts + 1)]
        if not runner.reserve_kv(0, context + drafts + 1):
            raise RuntimeError("no KV room")
        started = time.perf_counter()
        runner.execute([ScheduledChunk(0, tokens, context, True, num_drafts=drafts)])
        times.append(time.perf_counter() - started)
        runner.trim_kv(0, context)
    return statistics.median(times) * 1e3


def fit(relative: dict[int, float]) -> tuple[float, float]:
    points = [(d, cost - 1.0) for d, cost in relative.items() if d > 0]
    mean_d = statistics.fmean(d for d, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = sum((d - mean_d) * (y - mean_y) for d, y in points) / sum(
        (d - mean_d) ** 2 for d, _ in points
    )
    return mean_y - slope * mean_d, slope


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    runner = load(name, args.threads)
    try:
        prompt = [(i * 7) % 5000 + 100 for i in range(args.context)]
        runner.add_sequence(0, SamplingParams(max_tokens=16, temperature=0.0), prompt, None)
        if not runner.reserve_kv(0, args.context):
            raise RuntimeError("no KV room")
        runner.execute([ScheduledChunk(0, prompt, 0, True)])
        rounds: list[dict[int, float]] = []
        for round_index in range(args.rounds):
            order = alternate(args.drafts, round_index)
            rounds.append({d: step_ms(runner, args.context, d, args.reps) for d in order})
        ms = {d: statistics.median(r[d] for r in rounds) for d in args.drafts}
    finally:
        runner.close()
    relative = {d: ms[d] / ms[0] for d in args.drafts}
    first, per_draft = fit(relative)
    print(
        f"{name:9} "
        + "  ".join(f"d={d}: {ms[d]:.1f} ms ({relative[d]:.2f})" for d in ms)
        + f"\n{'':9} fit: first {first:.3f}, per_draft {per_draft:.3f}",
        flush=True,
    )
    return {"runner": name, "ms": ms, "relative": relative, "first": first, "per_draft": per_draft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runners", nargs="+", default=["llama.cpp", "torch"])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if 0 not in args.drafts:
        args.drafts.insert(0, 0)
    results = [measure(name, args) for name in args.runners]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {"context": args.context, "threads": args.threads, "runners": results}
        args.output.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
