"""The harness under the A/B subcommands (``bench sweep``, ``bench runners``,
``bench prefix-cache``, ``bench speculative``); each of them only says what its arms are and
what load they get.

Arms (servers, or configurations of one) run in turn, round after round, the order reversed
every other round: a machine whose speed drifts over minutes then slows every arm alike. A
figure is the median over rounds; a comparison is the median of per-round paired ratios, so one
slow round moves neither. Every subcommand writes ``NAME.json`` (the summary and its runs),
``NAME.md`` (its table) and ``runs/*.json`` (each run on its own, as a vLLM-style result) into
its ``--output-dir``, and prints its table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Unpack

from rich.console import Console
from rich.table import Table

from slotserve.bench.datasets import Conversation
from slotserve.bench.loadgen import LoadConfig, LoadOptions
from slotserve.bench.runner import run_benchmark, write_run_json
from slotserve.bench.servers import (
    RunningServer,
    ServerSpec,
    add_peer_program_argument,
    find_llama_server,
    llama_cpp_python_spec,
    llama_server_spec,
    running,
    slotserve_spec,
)
from slotserve.bench.vllm_peer import VLLM_PEERS, VllmPeer, add_vllm_arguments, prepare_vllm

T = TypeVar("T")

# Flags every subcommand shares.


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")


def add_round_arguments(parser: argparse.ArgumentParser, *, rounds: int, ctx_per_slot: int) -> None:
    """``--rounds``, and the ``--threads`` and ``--ctx-per-slot`` every server is given."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ctx-per-slot", type=int, default=ctx_per_slot)


def add_concurrency_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--concurrency", default=default, help="comma-separated")


def concurrency_levels(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


def add_peer_arguments(
    parser: argparse.ArgumentParser,
    choices: Sequence[str],
    default: list[str],
    peers_help: str,
    *,
    hf_folder: bool = True,
) -> None:
    """``--peers``, where each one is found (``--llama-server``, ``--vllm-python``) and, with
    ``hf_folder``, vLLM's ``--hf-folder``."""
    parser.add_argument("--peers", nargs="*", choices=choices, default=default, help=peers_help)
    if "llama-server" in choices:
        add_peer_program_argument(
            parser,
            "--llama-server",
            help="llama-server binary (default: the one build_llama_server.sh made, "
            "or llama-server on PATH)",
        )
    add_vllm_arguments(parser, hf_folder=hf_folder)


def add_output_dir_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """``--output-dir``, by default a new ``benchmarks/results/NAME-<date>-<time>``."""
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("benchmarks/results") / time.strftime(f"{name}-%Y%m%d-%H%M%S"),
    )


# The arms.


def alternate(arms: Sequence[T], index: int) -> list[T]:
    """``arms`` in order for an even round (or cell) ``index``, reversed for an odd one."""
    return list(arms) if index % 2 == 0 else list(reversed(arms))


@dataclass(frozen=True)
class Servers:
    """How each arm's server starts: the peers found installed (``peers``, in the order they
    run), else slotserve, all on one model, thread count and context per slot."""

    model: Path
    threads: int
    ctx_per_slot: int
    peers: list[str]
    llama_server: Path | None = None
    vllm: VllmPeer | None = None

    def spec(self, name: str, slots: int, slotserve_args: Sequence[str] = ()) -> ServerSpec:
        """Peer ``name``'s server, or else slotserve's with ``slotserve_args``."""
        threads, ctx_per_slot = self.threads, self.ctx_per_slot
        if name in VLLM_PEERS:
            assert self.vllm is not None, f"{name} is not installed"
            return self.vllm.spec(name, slots, threads, ctx_per_slot)
        if name == "llama-server":
            assert self.llama_server is not None, f"{name} is not installed"
            return llama_server_spec(self.llama_server, self.model, slots, threads, ctx_per_slot)
        if name == "llama-cpp-python":
            return llama_cpp_python_spec(self.model, threads, ctx_per_slot)
        return slotserve_spec(self.model, slots, threads, ctx_per_slot, slotserve_args)


# The session a subcommand runs in.


def run(body: Callable[[Session, argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Runs ``body`` in the session ``args`` open; exit status 2 when there is no model."""
    session = Session.open(args)
    return 2 if session is None else body(session, args)


@dataclass(frozen=True)
class Session:
    """A subcommand's console, the model its servers load and its output folder."""

    console: Console
    model: Path
    out_dir: Path

    @classmethod
    def open(cls, args: argparse.Namespace) -> Session | None:
        """The session ``--model`` and ``--output-dir`` describe (the folder made); None after
        printing why there is no model."""
        from slotserve.hosting.source import ModelUnavailableError, resolve_model_path

        console = Console()
        try:
            model = resolve_model_path(args.model)
        except ModelUnavailableError as exc:
            console.print(f"[red]{exc}")
            return None
        out_dir: Path = args.output_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        return cls(console, model, out_dir)

    def servers(self, wanted: Sequence[str], args: argparse.Namespace) -> Servers:
        """The peers of ``wanted`` that are installed, after a note for each that is not."""
        peers: list[str] = []
        llama_server = None
        if "llama-server" in wanted:
            llama_server = find_llama_server(args.llama_server)
            if llama_server is None:
                self.console.print(
                    "[yellow]llama-server not found: run benchmarks/build_llama_server.sh "
                    "or pass --llama-server PATH; skipping it"
                )
            else:
                peers.append("llama-server")
        if "llama-cpp-python" in wanted:
            if importlib.util.find_spec("sse_starlette") is not None:  # its server's extras
                peers.append("llama-cpp-python")
            else:
                self.console.print(
                    "[yellow]llama-cpp-python's server needs its extras "
                    "(pip install -e '.\\[peers]'); skipping it"
                )
        vllm = prepare_vllm(list(wanted), self.model, args, self.console)
        if vllm is not None:
            peers += [name for name in dict.fromkeys(wanted) if name in VLLM_PEERS]
        return Servers(self.model, args.threads, args.ctx_per_slot, peers, llama_server, vllm)

    def start(self, spec: ServerSpec) -> AbstractContextManager[RunningServer]:
        """The server of ``spec``, started and always stopped; its log under ``logs/``."""
        return running(spec, self.out_dir / "logs")

    def measure(
        self,
        server: RunningServer,
        conversations: list[Conversation],
        *,
        concurrency: int,
        warmup: int,
        label: str = "",
        show_progress: bool = True,
        **load: Unpack[LoadOptions],
    ) -> dict[str, Any]:
        """One run of ``conversations`` against ``server``: its flat report."""
        config = LoadConfig(base_url=server.api_url, concurrency=concurrency, **load)
        return run_benchmark(
            config,
            conversations,
            warmup=warmup,
            server_pid=server.pid,
            show_progress=show_progress,
            label=label,
        )

    def write_run(self, report: dict[str, Any], name: str) -> None:
        write_run_json(report, self.out_dir / "runs" / f"{name}.json")

    def save(self, name: str, result: dict[str, Any], markdown: str) -> list[Path]:
        """``NAME.json`` and ``NAME.md``, written."""
        paths = [self.out_dir / f"{name}.json", self.out_dir / f"{name}.md"]
        paths[0].write_text(json.dumps(result, indent=2) + "\n")
        paths[1].write_text(markdown + "\n")
        return paths

    def show(self, table: Table, *, wide: bool = False) -> None:
        """``wide``: at least 200 columns, so a table of many columns is never squeezed."""
        console = Console(width=max(self.console.width, 200)) if wide else self.console
        console.print(table)

    def done(self, paths: Sequence[Path]) -> int:
        self.console.print("results: " + ", ".join(str(p) for p in paths))
        return 0

    def finish(self, name: str, result: dict[str, Any], markdown: str, table: Table) -> int:
        """Writes the result, shows its table and says where it is; the exit status."""
        paths = self.save(name, result, markdown)
        self.show(table)
        return self.done(paths)


# The summary.


def median(values: Iterable[float]) -> float:
    """The median; NaN for no values."""
    listed = list(values)
    return statistics.median(listed) if listed else float("nan")


def paired_median(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-round ratios (rounds whose denominator is 0 left out)."""
    pairs = zip(numerators, denominators, strict=True)
    return median(a / b for a, b in pairs if b > 0)


def matching(runs: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The runs whose ``fields`` have these values, in round order."""
    chosen = (r for r in runs if all(r[k] == v for k, v in fields.items()))
    return sorted(chosen, key=lambda r: int(r["round"]))


def series(runs: Iterable[dict[str, Any]], key: str, **fields: Any) -> list[float]:
    """``key`` of the runs ``matching`` ``fields``, in round order."""
    return [float(r[key]) for r in matching(runs, **fields)]


def metrics_of(report: dict[str, Any]) -> dict[str, Any]:
    """A run's flat metrics: its report without the samples and the load config (the
    workload's, recorded once in the summary)."""
    return {k: v for k, v in report.items() if k not in ("samples", "config")}


def summary(args: argparse.Namespace, workload: dict[str, Any], **parts: Any) -> dict[str, Any]:
    """A subcommand's result: when, on what, its ``workload`` (with the rounds and threads of
    ``add_round_arguments``), then ``parts``."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count()},
        "workload": {**workload, "rounds": args.rounds, "threads": args.threads},
        **parts,
    }


# The tables.


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]], caption: str = "") -> str:
    """The table, after ``caption`` and a blank line when there is a caption."""
    lines = [caption, ""] if caption else []
    lines += ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def rich_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    justify: Literal["left", "right"] = "left",
) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify=justify)
    for row in rows:
        table.add_row(*row)
    return table
