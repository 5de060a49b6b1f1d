"""``slotserve bench speculative``: speculative decoding on vs off through the server, per
runner, workload and concurrency.

Per round and runner, one server with ``--speculative-config`` and one without, both started
and loaded one at a time (which goes first alternates from cell to cell, so the host's drifts
in speed over minutes fall on both sides); each serves every workload at every concurrency:
``--requests-per-client`` chat requests per client, at least ``--min-requests`` (greedy, up to
``--max-tokens``), after one uncounted request per client.
Workloads: **edit** (copy or lightly edit a given text or piece of code: the answer is mostly
in the prompt) and **open** (open-ended explanations: nothing to copy). Reported per cell:
output tok/s (prefill included) and decode tok/s (1 / median TPOT), the ratios on ÷ off
(medians of per-round paired ratios), and the acceptance the server's spec-decode counters
saw.
"""

from __future__ import annotations

import argparse
import itertools
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

from slotserve.bench import ab
from slotserve.bench.datasets import Conversation, edit_dataset, open_dataset
from slotserve.bench.servers import RunningServer, ServerSpec, slotserve_spec

RUNNERS = ("torch", "llama.cpp")
WORKLOADS = {"edit": edit_dataset, "open": open_dataset}
DEFAULT_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def add_spec_ab_arguments(parser: argparse.ArgumentParser) -> None:
    ab.add_model_argument(parser)
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["edit", "open"])
    ab.add_concurrency_argument(parser, "1,4,16")
    parser.add_argument("--speculative-config", default=DEFAULT_CONFIG)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=12,
        help="at least this many per cell (12: every edit task once, at any concurrency)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    ab.add_round_arguments(parser, rounds=1, ctx_per_slot=1024)
    ab.add_output_dir_argument(parser, "speculative")


def main_spec_ab(args: argparse.Namespace) -> int:
    return ab.run(_speculative, args)


def _speculative(session: ab.Session, args: argparse.Namespace) -> int:
    levels = ab.concurrency_levels(args)
    runs: list[dict[str, Any]] = []
    cell = 0
    for round_index in range(args.rounds):
        for runner in args.runners:
            with ExitStack() as stack:
                servers = {
                    spec_on: stack.enter_context(
                        session.start(_server_spec(session.model, runner, spec_on, levels, args))
                    )
                    for spec_on in (False, True)
                }
                for workload in args.workloads:
                    for level in levels:
                        # Both servers are up, only one is loaded at a time (an idle one waits
                        # on its queue); which goes first alternates cell by cell, so drifts in
                        # the host's speed fall on both sides.
                        for spec_on in ab.alternate((True, False), cell):
                            run = _one_run(
                                session, servers[spec_on], workload, level, round_index, args
                            )
                            run.update(runner=runner, speculation=spec_on)
                            runs.append(run)
                            _report_run(run, session)
                        cell += 1
    result = _summarize(args, levels, runs)
    return session.finish("speculative", result, _markdown(result), _table(result))


def _server_spec(
    model: Path, runner: str, spec_on: bool, levels: list[int], args: argparse.Namespace
) -> ServerSpec:
    extra = ["--runner", runner, "--max-model-len", str(args.ctx_per_slot)]
    if spec_on:
        extra += ["--speculative-config", args.speculative_config]
    return slotserve_spec(model, max(levels), args.threads, args.ctx_per_slot, extra)


def _report_run(run: dict[str, Any], session: ab.Session) -> None:
    on = "on" if run["speculation"] else "off"
    session.write_run(
        run["report"],
        f"{run['runner']}-{run['workload']}-x{run['concurrency']}-{on}-r{run['round']}",
    )
    session.console.print(
        f"round {run['round'] + 1} {run['runner']:9} {run['workload']:5} ×{run['concurrency']:<3} "
        f"{on:3} {run['output_tps']:7.1f} tok/s decode {run['decode_tps']:7.1f} tok/s"
    )


def _one_run(
    session: ab.Session,
    server: RunningServer,
    workload: str,
    level: int,
    round_index: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    make = WORKLOADS[workload]
    seed = round_index * 1000 + level
    warmup: list[Conversation] = make(level, args.max_tokens, seed + 500)
    session.measure(server, warmup, concurrency=level, warmup=0, show_progress=False)
    before = spec_counters(server.spec.base_url)
    num = max(level * args.requests_per_client, args.min_requests)
    conversations = make(num, args.max_tokens, seed)
    report = session.measure(
        server, conversations, concurrency=level, warmup=0, show_progress=False
    )
    after = spec_counters(server.spec.base_url)
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report.get('errors')}")
    counts = {key: after[key] - before[key] for key in COUNTERS}
    return {
        "round": round_index,
        "workload": workload,
        "concurrency": level,
        "output_tps": float(report["output_throughput"]),
        "decode_tps": 1000.0 / float(report["median_tpot_ms"]),
        "spec_decode": counts,
        "report": report,
    }


def spec_counters(base_url: str) -> dict[str, float]:
    """The server's ``vllm:spec_decode_*`` totals (zeros when speculation is off)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in COUNTERS:
                if sample.name == f"vllm:spec_decode_{key}_total":
                    totals[key] += sample.value
    return totals


def _summarize(
    args: argparse.Namespace, levels: list[int], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    cells = []
    for runner, workload, level in itertools.product(args.runners, args.workloads, levels):
        where = {"runner": runner, "workload": workload, "concurrency": level}
        on_runs = ab.matching(runs, **where, speculation=True)
        drafted = sum(r["spec_decode"]["num_draft_tokens"] for r in on_runs)
        accepted = sum(r["spec_decode"]["num_accepted_tokens"] for r in on_runs)
        cell: dict[str, Any] = dict(where)
        for key in ("output", "decode"):
            on = ab.series(runs, f"{key}_tps", **where, speculation=True)
            off = ab.series(runs, f"{key}_tps", **where, speculation=False)
            cell |= {
                f"off_{key}_tps": ab.median(off),
                f"on_{key}_tps": ab.median(on),
                f"{key}_ratio": ab.paired_median(on, off),
            }
        cell |= {"draft_tokens": drafted, "acceptance": accepted / drafted if drafted else None}
        cells.append(cell)
    workload = {
        "concurrency": levels,
        "requests_per_client": args.requests_per_client,
        "min_requests": args.min_requests,
        "max_tokens": args.max_tokens,
        "speculative_config": json.loads(args.speculative_config),
    }
    recorded = [{k: v for k, v in r.items() if k != "report"} for r in runs]  # reports: runs/
    return ab.summary(args, workload, cells=cells, runs=recorded)


def _rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for cell in result["cells"]:
        acceptance = cell["acceptance"]
        rows.append(
            [
                cell["runner"],
                cell["workload"],
                str(cell["concurrency"]),
                f"{cell['off_output_tps']:.1f}",
                f"{cell['on_output_tps']:.1f}",
                f"{cell['output_ratio']:.2f}",
                f"{cell['off_decode_tps']:.1f}",
                f"{cell['on_decode_tps']:.1f}",
                f"{cell['decode_ratio']:.2f}",
                "-" if acceptance is None else f"{acceptance:.2f} of {cell['draft_tokens']:.0f}",
            ]
        )
    return rows


HEADERS = (
    "runner", "workload", "streams", "off tok/s", "on tok/s", "on ÷ off",
    "off decode tok/s", "on decode tok/s", "decode on ÷ off", "accepted",
)  # fmt: skip


def _markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    caption = (
        f"Chat, greedy, up to {w['max_tokens']} tokens, {w['requests_per_client']} requests per "
        f"client (at least {w['min_requests']}), medians of {w['rounds']} rounds (ratios: "
        "medians of paired ratios), "
        f"{w['threads']} threads; on: `{json.dumps(w['speculative_config'])}`."
    )
    return ab.markdown_table(HEADERS, _rows(result), caption)


def _table(result: dict[str, Any]) -> Table:
    return ab.rich_table("speculative decoding: on vs off", HEADERS, _rows(result))
