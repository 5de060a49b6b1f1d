"""What constrained decoding costs: the grammar library's mask alone, and whole
engine decode steps with and without a JSON-schema constraint.

1. ``masks``: 16 matchers walking the same JSON document token by token; per step, the time to
   fill 16 token masks — llguidance (what the engine uses) and xgrammar (vLLM's default) when
   it is importable (``pip install --no-deps --target DIR xgrammar apache-tvm-ffi`` and put
   DIR on PYTHONPATH: its wheel requires triton, which the CPU install does not need).
2. ``engine``: the embedded model on one runner, B streams (greedy, 64 random prompt tokens,
   ``--max-tokens`` each), plain vs constrained to a schema whose one string field cannot end
   within the limit (so both runs decode the same number of tokens). Rounds alternate the two
   and the ratio per round is constrained ÷ plain decode step time.

    python benchmarks/grammar_mask_cost.py --runner llama.cpp torch --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.decoding.structured_output import GrammarMasks, grammar_of
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput
from slotserve.hosting.source import embedded_model_path
from slotserve.runners.llama_cpp.frontend import LlamaCppFrontend

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]}'
ENDLESS = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 5000}},
    "required": ["story"],
}


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 3)


def mask_cost(streams: int) -> dict[str, Any]:
    frontend = LlamaCppFrontend(embedded_model_path())
    tokenizer = frontend.tokenizer

    info = _info_of(tokenizer)
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    masks = GrammarMasks(tokenizer, info)
    matchers = [masks.matcher(spec) for _ in range(streams)]
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    bitmask = llg_numpy.allocate_token_bitmask(streams, info.vocab_size)
    executor = llguidance.LLExecutor()
    llg_steps = []
    for token in ids:
        started = time.perf_counter()
        llg_numpy.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        llg_steps.append(time.perf_counter() - started)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    result: dict[str, Any] = {
        "streams": streams,
        "tokens": len(ids),
        "llguidance_ms_per_step": _ms(llg_steps),
        "llguidance_grammar": grammar_of(spec)[:60],
    }
    try:
        import xgrammar as xgr  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        result["xgrammar"] = "not installed"
        return result
    encoded = [tokenizer.token_bytes(t) for t in range(info.vocab_size)]
    started = time.perf_counter()
    tok_info = xgr.TokenizerInfo(encoded, stop_token_ids=sorted(info.eog_token_ids))
    compiler = xgr.GrammarCompiler(tok_info, max_threads=2)
    compiled = compiler.compile_json_schema(json.dumps(PERSON))
    result["xgrammar_compile_s"] = round(time.perf_counter() - started, 3)
    xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(streams)]
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    xmask = xgr.allocate_token_bitmask(streams, info.vocab_size)
    x_steps = []
    for token in ids:
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask(xmatchers, xmask)
        x_steps.append(time.perf_counter() - started)
        for m in xmatchers:
            assert m.accept_token(token)
    result["xgrammar_ms_per_step"] = _ms(x_steps)
    return result


def _info_of(tokenizer: Any) -> Any:
    from slotserve.engine.runner_interface import ModelInfo

    return ModelInfo(
        "probe", tokenizer.vocab_size, 1, 512, tokenizer.eog_token_ids, None, "", "", "probe"
    )


def engine_steps(core: EngineCore, batch: int, max_tokens: int, constrained: bool) -> float:
    """Median seconds of the decode steps (every stream past its prompt)."""
    rng = random.Random(7)
    vocab = core.model_info.vocab_size
    constraint = StructuredOutput("json_schema", json.dumps(ENDLESS)) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=constraint)
    produced: dict[str, int] = {}
    for i in range(batch):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(64)]
        request_id = f"{constrained}-{i}-{time.time()}"
        produced[request_id] = 0
        core.add_request(EngineCoreRequest(request_id, prompt, params))
    steps = []
    while core.has_work:
        decoding = all(produced.values())  # every stream past its prompt
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        for out in outputs:
            produced[out.request_id] = out.num_output_tokens
        if decoding and outputs:
            steps.append(elapsed)
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", nargs="+", default=["llama.cpp", "torch"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/latest/grammar-cost.json"))
    args = parser.parse_args()
    from engine_steps import build  # this folder is on sys.path when run as a script

    report: dict[str, Any] = {"masks": mask_cost(16), "engine": []}
    print(json.dumps(report["masks"]))
    for runner in args.runner:
        core = build(runner, max(args.batch_sizes), args.threads)
        for batch in args.batch_sizes:
            ratios, plain_ms, constrained_ms = [], [], []
            engine_steps(core, batch, 4, False)  # warm-up
            for _ in range(args.rounds):
                plain = engine_steps(core, batch, args.max_tokens, False)
                constrained = engine_steps(core, batch, args.max_tokens, True)
                plain_ms.append(plain * 1000)
                constrained_ms.append(constrained * 1000)
                ratios.append(constrained / plain)
            row = {
                "runner": runner,
                "streams": batch,
                "plain_step_ms": round(statistics.median(plain_ms), 2),
                "constrained_step_ms": round(statistics.median(constrained_ms), 2),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratios": [round(r, 3) for r in ratios],
            }
            report["engine"].append(row)
            print(json.dumps(row))
        core.runner.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
