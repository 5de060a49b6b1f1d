"""Per-request measurements and the summary computed from them.

Key names follow ``vllm bench serve`` where the meaning matches, so result files compare.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestResult:
    """What one request did, as seen by the client."""

    prompt_id: str
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter seconds
    ttft: float = 0.0  # seconds from send to the first content chunk
    latency: float = 0.0  # seconds from send to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0  # from the server's final usage
    output_tokens: int = 0
    text: str = ""
    temperature: float = 0.0
    usage_estimated: bool = False  # no usage from the server: tokens counted from chunks
    turn: int = 0  # the conversation's turn, from 0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default method)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _describe(prefix: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    out = {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{prefix}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{prefix}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
    }
    for q in PERCENTILES:
        out[f"p{q}_{prefix}_ms"] = percentile(ms, q)
    return out


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughput and latency figures for the counted requests of one run."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # Time per output token excludes the first token, as vLLM defines it.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_with_estimated_usage": sum(r.usage_estimated for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0
        else 0.0,
    }
    summary.update(_describe("ttft", [r.ttft for r in ok]))
    summary.update(_describe("tpot", tpot))
    summary.update(_describe("itl", [gap for r in ok for gap in r.itl]))
    summary.update(_describe("e2el", [r.latency for r in ok]))
    return summary


def _ttft_percentiles(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """TTFT p50 and p90 in ms; None without requests, where 0 would read as instant."""
    ms = [r.ttft * 1000.0 for r in results]
    return {f"p{q}": percentile(ms, q) if ms else None for q in (50, 90)}


def turn_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """TTFT of first turns apart from later ones, and each turn's figures. A later turn resends
    its conversation's history, which a server's prompt cache can reuse; a first turn has only
    what conversations share."""
    ok = [r for r in results if r.success]
    first = [r for r in ok if r.turn == 0]
    later = [r for r in ok if r.turn > 0]
    summary: dict[str, Any] = {"completed_turn1": len(first), "completed_turn2plus": len(later)}
    for name, group in (("turn1", first), ("turn2plus", later)):
        for stat, value in _ttft_percentiles(group).items():
            summary[f"{stat}_ttft_{name}_ms"] = value
    turns = []
    for turn in sorted({r.turn for r in ok}):
        group = sorted((r for r in ok if r.turn == turn), key=lambda r: r.prompt_id)
        prompt_tokens = [r.prompt_tokens for r in group]
        turns.append(
            {
                "turn": turn + 1,
                "completed": len(group),
                **{f"{stat}_ttft_ms": v for stat, v in _ttft_percentiles(group).items()},
                "mean_prompt_tokens": statistics.fmean(prompt_tokens),
                "prompt_tokens": prompt_tokens,
            }
        )
    summary["turns"] = turns
    return summary


def isolation_failures(results: Sequence[RequestResult]) -> list[list[RequestResult]]:
    """Groups of greedy requests of different conversations whose outputs came back
    byte-identical.

    Under greedy sampling two different prompts producing exactly the same (non-trivial) text
    almost always means one request saw another's state: a batching or KV isolation bug.
    Turns of one conversation (``prompt_id`` = ``conversation/turn``) share their history, so a
    model may legitimately repeat itself there; only matches across conversations count. A
    duration run resends the dataset (``conversation#lap``): a repeat is the same prompt.
    A small model's greedy completion of nonsense often falls into a loop of a few words (" what
    what what ...", " to the way of the way of ..."), the same for many prompts: such a reply
    (at most a quarter of its words distinct) says nothing about isolation and is skipped.
    """
    by_text: dict[str, list[RequestResult]] = {}
    for r in results:
        if r.success and r.temperature == 0.0 and len(r.text) >= 16 and not _looping(r.text):
            by_text.setdefault(r.text, []).append(r)
    return [
        sorted(group, key=lambda r: r.prompt_id)
        for group in by_text.values()
        if len({_source_conversation(r.prompt_id) for r in group}) > 1
    ]


def reproduced_alone(group: Sequence[RequestResult], alone: Mapping[str, RequestResult]) -> bool:
    """Whether every request of an isolation failure's ``group`` returned the same text when
    sent again by itself (``alone``, by prompt id): the identical replies are then the model's
    own answer to those prompts, not one request seeing another's state."""
    return all(
        r.prompt_id in alone and alone[r.prompt_id].success and alone[r.prompt_id].text == r.text
        for r in group
    )


def describe_isolation(group: Sequence[RequestResult]) -> dict[str, Any]:
    """An isolation group as the report lists it."""
    return {"prompt_ids": sorted({r.prompt_id for r in group}), "text": group[0].text[:200]}


def _looping(text: str) -> bool:
    words = text.split()
    return len(words) >= 8 and len(set(words)) * 4 <= len(words)


def _source_conversation(prompt_id: str) -> str:
    """``chat-3#2/1`` (turn 1 of the third resend of chat-3) -> ``chat-3``."""
    return prompt_id.rsplit("/", 1)[0].split("#", 1)[0]
