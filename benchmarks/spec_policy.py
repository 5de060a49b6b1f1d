"""The speculator's policy knobs, engine alone: the acceptance estimate's weight and
the most drafts per step, on the edit workload's twelve tasks (copy or edit a given text or
piece of code) or twelve open-ended questions (``--workload open``), one sequence at a time,
greedy, 128 tokens at most.

Per round every setting (and no speculation) runs all twelve tasks, in an order that rotates
between rounds; a setting's figure is its decode time summed over the tasks (from the first
output token to the last), and its ratio is off ÷ on per round, median over rounds.

    python benchmarks/spec_policy.py --runner llama.cpp --rounds 3 \
        --output benchmarks/latest/spec-policy-llama.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from verify_cost import load

import slotserve.engine.decoding.speculative as speculative
from slotserve.bench.datasets import edit_dataset, open_dataset
from slotserve.engine.config import EngineConfig, SpeculativeConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import Runner
from slotserve.engine.sampling_params import SamplingParams
from slotserve.protocol.chat_template import ChatTemplate


def decode_seconds(
    runner: Runner, setting: tuple[int, float] | None, prompts: list[list[int]]
) -> float:
    """Decode time over ``prompts`` with (K, weight), or without speculation (None)."""
    config = None
    if setting is not None:
        config = SpeculativeConfig(num_speculative_tokens=setting[0])
        speculative.ACCEPTANCE_WEIGHT = setting[1]
    core = EngineCore(runner, EngineConfig(num_slots=2, prefix_cache=False, speculative=config))
    total = 0.0
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=128, temperature=0.0)
        core.add_request(EngineCoreRequest(f"r{index}", prompt, params))
        first: float | None = None
        while core.has_work:
            outputs = core.step()
            if first is None and any(d.token_ids for o in outputs for d in o.deltas):
                first = time.perf_counter()
        assert first is not None
        total += time.perf_counter() - first
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runner", default="llama.cpp", choices=["llama.cpp", "torch"])
    parser.add_argument("--workload", default="edit", choices=["edit", "open"])
    parser.add_argument("--k", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--weights", type=float, nargs="+", default=[0.15, 0.25, 0.4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    runner = load(args.runner, args.threads)
    info = runner.model_info
    assert info.chat_template is not None
    template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    dataset = (edit_dataset if args.workload == "edit" else open_dataset)(12, 128)
    prompts = [
        runner.tokenizer.encode(template.render(c.messages(0)), add_special_tokens=False)
        for c in dataset
    ]
    settings: list[tuple[int, float] | None] = [None]
    settings += [(k, w) for k in args.k for w in args.weights]
    seconds: dict[str, list[float]] = {str(s): [] for s in settings}
    for round_index in range(args.rounds):
        shift = round_index % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            seconds[str(setting)].append(decode_seconds(runner, setting, prompts))
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items())
        )
    off = seconds["None"]
    rows = []
    for k, weight in [s for s in settings if s is not None]:
        on = seconds[str((k, weight))]
        ratio = statistics.median(a / b for a, b in zip(off, on, strict=True))
        rows.append({"k": k, "weight": weight, "seconds": on, "off_over_on": ratio})
        print(f"K={k:<3} weight {weight:.2f}: off ÷ on {ratio:.2f}")
    runner.close()
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "runner": args.runner,
            "workload": args.workload,
            "off_seconds": off,
            "settings": rows,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
