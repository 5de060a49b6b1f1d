"""The bench report: a rich table on the terminal, a JSON file, and the targets it must meet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a local process and all its descendants (Linux /proc): a server's
    engine process holds the model. None when the process itself cannot be read."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            if current == pid:
                return None
            continue  # a child that ended meanwhile
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        stack += [int(c) for c in children]
    return total


def render_table(summary: dict[str, Any], title: str, console: Console | None = None) -> None:
    """``summary``: a run report (its metrics are top-level keys, vLLM's names)."""
    console = console or Console()
    table = Table(title=title)
    table.add_column("metric")
    for column in ("mean", "median", "p95", "p99"):
        table.add_column(column, justify="right")
    for name, key in (
        ("TTFT (ms)", "ttft"),
        ("TPOT (ms)", "tpot"),
        ("ITL (ms)", "itl"),
        ("E2E latency (ms)", "e2el"),
    ):
        table.add_row(
            name,
            *(f"{summary[f'{stat}_{key}_ms']:.1f}" for stat in ("mean", "median", "p95", "p99")),
        )
    console.print(table)
    totals = Table(show_header=False, title="totals")
    totals.add_row("completed / failed", f"{summary['completed']} / {summary['failed']}")
    totals.add_row("duration (s)", f"{summary['duration']:.2f}")
    totals.add_row("request throughput (req/s)", f"{summary['request_throughput']:.2f}")
    totals.add_row("output throughput (tok/s)", f"{summary['output_throughput']:.1f}")
    totals.add_row("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")
    totals.add_row(
        "input / output tokens",
        f"{summary['total_input_tokens']} / {summary['total_output_tokens']}",
    )
    if "background" in summary:
        background = summary["background"]
        totals.add_row(
            f"background ×{background['streams']}: completed / failed",
            f"{background['completed']} / {background['failed']}",
        )
        totals.add_row(
            "background output throughput (tok/s)", f"{background['output_throughput']:.1f}"
        )
    console.print(totals)
    if "turns" in summary:
        console.print(_turns_table(summary))


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _turns_table(summary: dict[str, Any]) -> Table:
    """TTFT by turn: later turns resend what came before, so a prompt cache shows here."""
    table = Table(title="TTFT by turn")
    table.add_column("turn")
    for column in ("completed", "TTFT p50 (ms)", "TTFT p90 (ms)", "prompt tokens (mean)"):
        table.add_column(column, justify="right")
    for i, turn in enumerate(summary["turns"]):
        table.add_row(
            str(turn["turn"]),
            str(turn["completed"]),
            _ms(turn["p50_ttft_ms"]),
            _ms(turn["p90_ttft_ms"]),
            f"{turn['mean_prompt_tokens']:.0f}",
            end_section=i == len(summary["turns"]) - 1,
        )
    # Turn 1 has its row above already.
    table.add_row(
        "≥ 2",
        str(summary["completed_turn2plus"]),
        _ms(summary["p50_ttft_turn2plus_ms"]),
        _ms(summary["p90_ttft_turn2plus_ms"]),
        "",
    )
    return table


@dataclass(frozen=True)
class Targets:
    """Thresholds that make ``slotserve bench`` exit non-zero when missed."""

    min_output_tps: float | None = None
    speedup_baseline: Path | None = None
    min_speedup: float = 1.0
    max_p99_ttft_ms: float | None = None
    max_failed: int | None = None
    isolation: bool = True

    def missed(self, report: dict[str, Any]) -> list[str]:
        summary = report  # flat: vLLM's metric keys at the top level
        misses = []
        if self.min_output_tps is not None and summary["output_throughput"] < self.min_output_tps:
            misses.append(
                f"output throughput {summary['output_throughput']:.1f} tok/s < "
                f"{self.min_output_tps}"
            )
        if self.speedup_baseline is not None:
            base = json.loads(self.speedup_baseline.read_text())
            # Flat (ours, vLLM's) or nested under "summary" (our files before they were flat).
            base_tps = (base.get("summary") or base)["output_throughput"]
            speedup = summary["output_throughput"] / base_tps if base_tps else float("inf")
            report["speedup_vs_baseline"] = speedup
            if speedup < self.min_speedup:
                misses.append(
                    f"speedup {speedup:.2f}x over {self.speedup_baseline} < {self.min_speedup}x"
                )
        if self.max_p99_ttft_ms is not None and summary["p99_ttft_ms"] > self.max_p99_ttft_ms:
            misses.append(f"p99 TTFT {summary['p99_ttft_ms']:.0f} ms > {self.max_p99_ttft_ms}")
        if self.max_failed is not None and summary["failed"] > self.max_failed:
            misses.append(f"{summary['failed']} failed requests > {self.max_failed}")
        if self.isolation and report["isolation_failures"]:
            misses.append(
                f"isolation check: {len(report['isolation_failures'])} groups of "
                f"distinct prompts returned identical text"
            )
        return misses
