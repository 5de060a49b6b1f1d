"""The engine alone, no HTTP: the steps of the agent workload (``slotserve bench --dataset
agent``) on the PyTorch runner. A cached system-and-tools prefix is shared by ``--sharing``
decoding sequences beside ``--short`` unrelated ones; then a turn resends the prefix plus
``--new-tokens`` tokens. Prints, per trial, the step that prefills the turn and the median of
the decode steps after it, each with its time in attention and in the projections (timed around
their Python calls), then the medians over the trials.

    python benchmarks/agent_steps.py --trials 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_steps import all_decoding, build, timed_calls

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.model.layers import Projection


def timed_step(core: EngineCore, spent: dict[str, float]) -> dict[str, float]:
    """One engine step: its milliseconds in all, in attention and in the projections."""
    spent.clear()
    started = time.perf_counter()
    core.step()
    return {
        "step": 1e3 * (time.perf_counter() - started),
        "attention": 1e3 * spent.get("attention", 0.0),
        "projections": 1e3 * spent.get("projections", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=6200)
    parser.add_argument("--new-tokens", type=int, default=91, help="the turn's uncached tokens")
    parser.add_argument("--sharing", type=int, default=3, help="decoders sharing the prefix")
    parser.add_argument("--short", type=int, default=2, help="decoders of short prompts")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    core = build("torch", args.sharing + args.short + 1, args.threads, max_seq_len=8192)
    rng = random.Random(0)
    vocab = core.model_info.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id, prompt, params))

    def drain() -> None:
        while core.has_work:
            core.step()

    prefix = tokens(args.prefix_len)
    add("cache-the-prefix", prefix + tokens(60), 1)
    drain()
    spent: dict[str, float] = {}
    calls = [(CpuKernels, "paged_attention", "attention"), (Projection, "forward", "projections")]
    turns, decodes = [], []
    with timed_calls(calls, spent):
        for trial in range(args.trials):
            for j in range(args.sharing):
                add(f"agent-{trial}-{j}", prefix + tokens(300), 400)
            for j in range(args.short):
                add(f"background-{trial}-{j}", tokens(100), 400)
            while not all_decoding(core, args.sharing + args.short):
                core.step()
            core.step()
            add(f"turn-{trial}", prefix + tokens(args.new_tokens), 1)
            turn = timed_step(core, spent)
            steps = [timed_step(core, spent) for _ in range(5)]
            decode = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
            for request_id in core.live_request_ids:
                core.abort(request_id)
            drain()
            turns.append(turn)
            decodes.append(decode)
            print(json.dumps({"trial": trial, "turn_step_ms": turn, "decode_step_ms": decode}))
    print(
        json.dumps(
            {
                "median_turn_step_ms": statistics.median(t["step"] for t in turns),
                "median_turn_attention_ms": statistics.median(t["attention"] for t in turns),
                "median_decode_step_ms": statistics.median(d["step"] for d in decodes),
                "median_decode_attention_ms": statistics.median(d["attention"] for d in decodes),
            }
        )
    )


if __name__ == "__main__":
    main()
